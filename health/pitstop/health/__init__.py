"""Pure detection logic: Xid classification, failure and straggler detection,
checkpoint-interval math, goodput accounting. No I/O."""
