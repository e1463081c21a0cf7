"""The rendezvous service's keys and tokens: every key belongs to one rendezvous, and a
token of one record never passes for another's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.services.rendezvous import (
    check_run_id,
    check_token,
    issue_token,
)

run_ids = st.text(
    st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=40,
)
keys = st.one_of(run_ids, run_ids.map(lambda run: f"{run}/c10d-store"))
versions = st.integers(min_value=1, max_value=2**63 - 1)


@pytest.mark.parametrize("key", ["job-7", "job-7/c10d-store", "a.b:c@d", " spaced "])
def test_run_ids_and_their_records_are_keys(key: str) -> None:
    check_run_id(key)


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("", "give the rendezvous id"),
        ("/c10d-store", "give the rendezvous id before '/'"),
        ("job-7/", "--rdzv-id without '/'"),
        ("job-7/state", "--rdzv-id without '/'"),
        ("job-7/c10d-store/c10d-store", "--rdzv-id without '/'"),
        ("job-7//c10d-store", "--rdzv-id without '/'"),
        ("job-7/c10d-store/", "--rdzv-id without '/'"),
        ("r" * 254, "at most 253 characters"),
        ("nul\x00id", "remove the NUL"),
    ],
)
def test_keys_that_are_not_one_runs_record_are_refused(key: str, fix: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_run_id(key)
    assert caught.value.field == "run_id"
    assert fix in caught.value.fix


@given(run_ids, run_ids)
def test_a_run_id_is_never_another_runs_record(first: str, second: str) -> None:
    assert f"{first}/c10d-store" != second


@given(keys, versions)
def test_a_token_passes_for_its_own_record(key: str, version: int) -> None:
    check_token(key, issue_token(key, version))


@given(keys, keys, versions, versions)
def test_a_token_never_passes_for_another_record(
    issued_for: str, offered_to: str, version: int, current: int
) -> None:
    if issued_for == offered_to:
        return
    token = issue_token(issued_for, version)
    assert token != issue_token(offered_to, current)
    with pytest.raises(InvalidArgument) as caught:
        check_token(offered_to, token)
    assert caught.value.field == "token"


@pytest.mark.parametrize("token", ["", "1", "99999999999", "no-such-token", "1.abc"])
def test_tokens_of_no_record_are_merely_not_current(token: str) -> None:
    check_token("job-7", token)
