"""The dashboard's web server: one page, its script, a JSON API and one server-sent
event stream that keeps the page live (no reloads).

Served on a port of its own (`dashboard_port`), with TLS when the scheduler has it.
Read-only: every route needs a viewer (the same bearer tokens as the gRPC API, sent
as `Authorization: Bearer` or kept in an HttpOnly cookie by the sign-in form), and
a revoked token ends an open stream within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from pitstop.scheduler.auth import Caller, TokenBook, current_caller
from pitstop.scheduler.dashboard import data
from pitstop.scheduler.domain import Role
from pitstop.scheduler.errors import NotFound, PermissionDenied, PitstopError, Unauthenticated
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

COOKIE = "pitstop_token"
TICK_SECONDS = 1.0
"""How often an open stream sends the selected job's new steps and re-checks its token."""
JOB_REFRESH_SECONDS = 2.0
"""How often an open stream re-sends the selected job (its step moves without events)."""
_STATIC = resources.files("pitstop.scheduler.dashboard") / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Dashboard:
    """The dashboard of one scheduler process. `start` binds and returns the port."""

    def __init__(self, store: Store, hot: HotState, tokens: TokenBook) -> None:
        self.store, self.hot, self.tokens = store, hot, tokens
        self.tls = False
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/login", self._login_page)
        app.router.add_post("/login", self._login)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/fleet", self._fleet)
        app.router.add_get("/api/nodes/{node_id}", self._node)
        app.router.add_get("/api/jobs", self._jobs)
        app.router.add_get("/api/jobs/{job_id}", self._job)
        app.router.add_get("/api/jobs/{job_id}/record", self._record)
        app.router.add_get("/api/events", self._events)
        app.router.add_get("/api/stream", self._stream)
        self.app = app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self.tls = ssl_context is not None
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self._stopping.set()
        for task in list(self._streams):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    # Who may look -------------------------------------------------------------------

    def _presented(self, request: web.Request) -> str | None:
        header = request.headers.get("Authorization")
        if header:
            return header
        token = request.cookies.get(COOKIE)
        return f"Bearer {token}" if token else None

    def _check(self, presented: str | None) -> Caller:
        """The caller `presented` (an Authorization value) makes; Unauthenticated unless
        it is a viewer's."""
        metadata = [("authorization", presented)] if presented else []
        caller = self.tokens.caller_for(metadata)
        if Role.VIEWER not in caller.roles:
            raise Unauthenticated(f"{caller.name} may not view; use a viewer token or above")
        return caller

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in ("/login",) or request.path.startswith("/static/"):
            return await handler(request)
        token = request.query.get("token")
        if token and request.path == "/":
            # A link with ?token=: keep it in a cookie, take it out of the address bar.
            return self._signed_in(token, "/")
        try:
            caller = self._check(self._presented(request))
        except Unauthenticated as exc:
            if request.path.startswith("/api/"):
                return web.json_response({"error": str(exc)}, status=401)
            raise web.HTTPSeeOther("/login") from None
        # As on the gRPC API: what a token limited to projects may read is checked
        # against the caller (a job's record).
        entered = current_caller.set(caller)
        try:
            return await handler(request)
        except NotFound as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except PermissionDenied as exc:
            return web.json_response({"error": str(exc)}, status=403)
        except PitstopError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        finally:
            current_caller.reset(entered)

    def _signed_in(self, token: str, to: str) -> web.StreamResponse:
        try:
            self._check(f"Bearer {token}")
        except Unauthenticated as exc:
            return _login_form(str(exc), status=401)
        response = web.Response(status=303, headers={"Location": to})
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="Strict", secure=self.tls, path="/"
        )
        return response

    async def _login_page(self, request: web.Request) -> web.StreamResponse:
        return _login_form("")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        token = str(form.get("token", "")).strip()
        if not token:
            return _login_form("paste a token: pitstop token create --role viewer", status=400)
        return self._signed_in(token, "/")

    # The page -----------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        html = (_STATIC / "index.html").read_text()
        return web.Response(text=html, content_type="text/html")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        resource = _STATIC / name
        kind = _TYPES.get(name[name.rfind(".") :] if "." in name else "")
        if "/" in name or name.startswith(".") or kind is None or not resource.is_file():
            raise web.HTTPNotFound()
        return web.Response(text=resource.read_text(), content_type=kind)

    # JSON ---------------------------------------------------------------------------

    async def _fleet(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"nodes": await data.fleet(self.store)})

    async def _node(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await data.node_detail(self.store, self.hot, request.match_info["node_id"])
        )

    async def _jobs(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"jobs": await data.job_list(self.store)})

    async def _job(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await data.job_detail(self.store, self.hot, request.match_info["job_id"])
        )

    async def _record(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(await data.job_record(self.store, request.match_info["job_id"]))

    async def _events(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"events": await data.recent_events(self.store)})

    # Live ---------------------------------------------------------------------------

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the whole picture first, then what changes. Node events
        re-send the nodes they name, job events the job list and the selected job; every
        second the selected job's new steps; every two seconds the job itself."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        presented = self._presented(request)
        try:
            await self._feed(response, request.query.get("job", ""), presented)
        except Unauthenticated as exc:
            # Revoked or expired mid-stream: say so, and end (the page shows it).
            with contextlib.suppress(ConnectionResetError):
                body = json.dumps({"error": str(exc)})
                await response.write(f"event: denied\ndata: {body}\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        except Exception as exc:  # a store outage: end it; the page reconnects by itself
            log.warning("dashboard stream ended: %s", exc)
        finally:
            self._streams.discard(task)
        return response

    async def _feed(self, response: web.StreamResponse, job_id: str, presented: str | None) -> None:
        async def send(kind: str, payload: Any) -> None:
            body = json.dumps(payload, separators=(",", ":"))
            await response.write(f"event: {kind}\ndata: {body}\n\n".encode())

        events = await data.recent_events(self.store)
        last_event = events[-1]["id"] if events else 0
        jobs = await data.job_list(self.store)
        if not job_id:
            job_id = _default_job(jobs)
        await send("hello", {"job": job_id, "time": time.time()})
        await send("fleet", {"nodes": await data.fleet(self.store), "full": True})
        await send("jobs", {"jobs": jobs})
        await send("events", {"events": events})
        world_size = 0
        if job_id:
            try:
                job = await data.job_detail(self.store, self.hot, job_id)
            except NotFound as exc:  # a stale ?job= link: say so, show the rest
                await send("missing", {"job": job_id, "error": str(exc)})
                job_id = ""
            else:
                world_size = len(job["ranks"])
                await send("job", job)
        feed = data.StepFeed(job_id) if job_id else None
        version = self.store.bus.version
        job_sent = time.monotonic()
        while not self._stopping.is_set():
            self._check(presented)  # a revoked or expired token ends the stream
            if feed is not None:
                steps = await feed.update(self.hot, world_size)
                if steps is not None:
                    await send("steps", steps)
            version = await self.store.bus.wait(version, TICK_SECONDS)
            new = await data.events_after(self.store, last_event)
            job_changed = False
            if new:
                last_event = new[-1]["id"]
                await send("events", {"events": new})
                touched = {e["node"] for e in new if e["node"]}
                if touched:
                    await send("fleet", {"nodes": await data.fleet(self.store, touched)})
                if any(e["kind"].startswith("job.") for e in new):
                    await send("jobs", {"jobs": await data.job_list(self.store)})
                job_changed = any(e["job"] == job_id for e in new)
            if job_id and (job_changed or time.monotonic() - job_sent >= JOB_REFRESH_SECONDS):
                job = await data.job_detail(self.store, self.hot, job_id)
                if len(job["ranks"]) != world_size and feed is not None:
                    world_size = len(job["ranks"])
                    feed = data.StepFeed(job_id)  # a new shape: start the heatmap over
                await send("job", job)
                job_sent = time.monotonic()


def _default_job(jobs: list[dict[str, Any]]) -> str:
    """The newest unfinished job, else the newest job, else none."""
    for job in jobs:
        if job["state"] not in ("succeeded", "failed", "cancelled"):
            return str(job["id"])
    return str(jobs[0]["id"]) if jobs else ""


def _login_form(error: str, status: int = 200) -> web.Response:
    message = f'<p class="error" role="alert">{_escape(error)}</p>' if error else ""
    return web.Response(
        status=status,
        content_type="text/html",
        text=(
            "<!doctype html><html><head><meta charset='utf-8'><title>pitstop: sign in</title>"
            "<link rel='stylesheet' href='/static/style.css'></head><body class='login'>"
            "<form method='post' action='/login'><h1>pitstop</h1>"
            "<p>Sign in with an API token (viewer or above): <code>pitstop token create "
            "--role viewer --name NAME</code>, or a local cluster's "
            "<code>admin.token</code>.</p>"
            f"{message}<input type='password' name='token' autocomplete='off' "
            "placeholder='token' autofocus><button type='submit'>Sign in</button></form>"
            "</body></html>"
        ),
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def tls_context(cert_pem: bytes, key_pem: bytes, where: Path) -> ssl.SSLContext:
    """A server TLS context from PEM bytes (written 0600 under `where`: ssl reads files)."""
    directory = where
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "dashboard.crt", directory / "dashboard.key"
    for path, body in ((cert_file, cert_pem), (key_file, key_pem)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(body)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context
