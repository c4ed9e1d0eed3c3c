"""The two aiohttp apps, the error middleware they share, and running them until stopped.

* Unix socket (shared volume, trainer only): `control.ROUTES` plus `probes.ROUTES`,
  behind `socket_server.Server`, which answers the control routes itself and hands
  aiohttp what else comes.
* TCP on the pod IP (kubelet probes, Prometheus): `probes.ROUTES` only.
* TCP on 127.0.0.1 (`kubectl port-forward`): the read-only web inspector at /ui. It
  reads the dataset, so it never listens where other pods can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from shardcache import errors
from shardcache.contract import mixture_sources, protocol, variables
from shardcache.node import reader_locks, tiers
from shardcache_sidecar import configuration, listening, metrics, termination, tier_checks
from shardcache_sidecar.checkpoint import agent, hook
from shardcache_sidecar.server import control, lifecycle, probes, replies, socket_server
from shardcache_sidecar.ui import routes

# The logger name the sidecar's logs carried before the server was split.
log = logging.getLogger("shardcache_sidecar.server")

# Seconds in-flight requests get to finish after SIGTERM.
_SHUTDOWN_TIMEOUT = 3.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_to_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes a JSON body with a `kind`; every answer is counted by route."""
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "unmatched"
    )
    try:
        response = await handler(request)
    except replies.RequestError as exc:
        response = replies.error_response(exc)
    except web.HTTPException as exc:
        # aiohttp's own 404/405: same JSON shape as every other error.
        code = (
            protocol.CODE_UNKNOWN_ROUTE if exc.status in (404, 405) else protocol.CODE_BAD_REQUEST
        )
        message = f"{request.method} {request.path}: {exc.reason}"
        response = replies.error_response(
            replies.RequestError(exc.status, protocol.KIND_INPUT, code, message)
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        response = replies.error_response(replies.refusal(exc, request.method, request.path))
    request.app[lifecycle.SIDECAR].metrics.request(route, response.status)
    return response


def _app(sidecar: lifecycle.Sidecar) -> web.Application:
    app = web.Application(middlewares=[errors_to_json])
    app[lifecycle.SIDECAR] = sidecar
    app.add_routes(probes.ROUTES)
    return app


def control_app(sidecar: lifecycle.Sidecar) -> web.Application:
    """The Unix socket's app: probes and the control API."""
    app = _app(sidecar)
    app.add_routes(control.ROUTES)
    return app


def probe_app(sidecar: lifecycle.Sidecar) -> web.Application:
    """The pod-IP port's app: /healthz, /readyz and /metrics, nothing else."""
    return _app(sidecar)


def ui_app(sidecar: lifecycle.Sidecar) -> web.Application:
    """The loopback port's app: the web inspector (/ui), never on the socket."""
    app = web.Application(middlewares=[errors_to_json])
    app[lifecycle.SIDECAR] = sidecar
    defaults = routes.Defaults.from_plan(sidecar.settings.startup_plan())
    routes.mount(app, routes.NodeInspector(sidecar.serving), defaults)
    return app


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a killed sidecar; refuse if one is still serving."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale control socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except OSError as exc:
        raise errors.InputError(
            f"{path} exists and is not a usable socket ({exc}); remove it"
        ) from exc
    finally:
        probe.close()
    raise errors.InputError(
        f"another sidecar is already serving on {path}: stop it first, or use another run directory"
    )


def _missing(path: Path) -> list[Path]:
    """`path` and the directories above it that do not exist, outermost first."""
    missing: list[Path] = []
    # os.path's answers never raise: a directory this user may not look into is one
    # to report when making it fails, not a traceback here.
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def make_directories(settings: configuration.Settings) -> list[Path]:
    """The control socket's and the memory tier's directories of every source, made
    before anything listens, so that one this user cannot make is refused like a bad
    setting, described as the tier check describes a tier directory (the user, the
    owner and mode of what is there). Returns the directories this call made,
    outermost first, for `remove_made` when the start is refused after all."""
    made: list[Path] = []
    for source in source_settings(settings):
        places = (
            (source.socket_path.parent, "the control socket's directory", "socket_path"),
            (source.memory_dir, "the memory tier", "memory_dir"),
        )
        for path, what, field in places:
            missing = _missing(path)
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                remove_made([*made, *(m for m in missing if os.path.isdir(m))])
                # Either the directory's own flag moved it or the run directory placed it.
                set_by = " or ".join(configuration.where_set(f) for f in (field, "run_dir"))
                raise errors.InputError(
                    f"cannot create {what} {str(path)!r} (set by {set_by}): "
                    f"{tier_checks.creation_failure(path, exc)}"
                ) from exc
            made += missing
    return made


def remove_made(made: list[Path]) -> None:
    """Take back the directories `make_directories` made, innermost first, each only
    while empty: a refused start leaves nothing behind, and nothing else is touched."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            path.rmdir()


def exit_reason(sidecar: lifecycle.Sidecar) -> str | None:
    """Why a sidecar that is stopping never served, for its termination message: its
    tier directories were unusable (the kubelet killed it when the startup probe gave
    up), or it refused its settings (a digest mismatch, ...); None after serving."""
    if sidecar.tier_problems:
        return "the sidecar could not start: " + "; ".join(sidecar.tier_problems.values())
    problem = sidecar.problem
    if problem is not None and problem.kind == protocol.KIND_INPUT:
        return f"the sidecar refused to serve: {problem.message}"
    return None


#: Seconds between looks at the further sources' readiness (a multi-source mount).
_SOURCES_POLL = 0.2
MIXTURE_GATE = "mixture-sources"


def source_settings(settings: configuration.Settings) -> list[configuration.Settings]:
    """The settings of every source a sidecar serves: one, or each of a mixture's.

    The first source is the mount's own (its socket, its probe and inspector ports, its
    checkpoint agent). Each further source is served like a mount of its own, at
    `<mount dir>/sources/<name>/` (socket and memory tier), with its own URI, format and
    pinned digest, and no TCP port anyone is told of (probes and inspector on ports the
    kernel picks): the first source's /readyz waits for every source instead. The
    memory tier (`cache.memory`) is shared out equally between the sources, since they
    live in the one run volume sized for it; the disk tier is one, as for any sidecars
    of a node.
    """
    mixture = settings.mixture
    if mixture is None:
        return [settings]
    share = settings.memory_limit // len(mixture.sources)
    mount_dir = settings.socket_path.parent
    out = [dataclasses.replace(settings, memory_limit=share)]
    for source in mixture.sources[1:]:
        out.append(
            dataclasses.replace(
                settings,
                source_uri=source.uri,
                source_format=source.format,
                manifest_digest=source.digest,
                socket_path=mixture_sources.socket_of(mount_dir, mixture, source.name),
                memory_dir=mixture_sources.memory_of(mount_dir, mixture, source.name),
                memory_limit=share,
                metrics_port=0,
                ui_port=0,
                checkpoint=None,
                mixture=None,
            )
        )
    return out


def disk_limit_within_volume(settings: configuration.Settings) -> configuration.Settings:
    """`settings` with the disk tier's limit at most its volume's size, said in the log
    when clamped: a limit the volume can never hold (the default is a fixed 50 GiB) is
    only found out by a full disk, and shows in /v1/status and the metrics as room
    that is not there. A WARNING when the limit was set, INFO for the default
    (`tiers.clamp_level`). `shardcache.open()` clamps a limit it is given alike and
    sizes its default from the free space."""
    found = tiers.volume_under(settings.disk_dir)
    limit = tiers.limit_within(settings.disk_limit, found)
    if limit == settings.disk_limit or found is None:
        return settings
    # The webhook writes the default for a mount that names no cache.disk, so the
    # value, not whether the variable is present, tells a limit someone chose.
    default = settings.disk_limit == variables.DISK_LIMIT.required_default
    log.log(
        tiers.clamp_level(explicit=not default),
        "disk tier limit %d bytes (%s%s) exceeds its volume %s of %d bytes (%d free): "
        "using %d bytes; set the limit to what the node's volume can hold",
        settings.disk_limit,
        "the default of " if default else "",
        configuration.where_set("disk_limit"),
        settings.disk_dir,
        found.total,
        found.free,
        limit,
    )
    return dataclasses.replace(settings, disk_limit=limit)


def write_descriptor(settings: configuration.Settings) -> None:
    """`<mount dir>/mixture.json`, where `shardcache.open_mixture()` finds the sources
    (written whole, then renamed, so a reader never sees part of it)."""
    assert settings.mixture is not None
    path = settings.socket_path.parent / mixture_sources.DESCRIPTOR_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings.mixture.to_json(), indent=1))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


async def serve(
    settings: configuration.Settings,
    stop: asyncio.Event,
    *,
    on_start: Callable[[lifecycle.Sidecar], None] | None = None,
) -> None:
    """Run the sidecar until `stop` is set; then shut down cleanly and remove the socket.

    A multi-source mount (`settings.mixture`) runs one cache per source in this process
    (`source_settings`); /readyz of the first opens only when every source is ready.
    """
    settings = disk_limit_within_volume(settings)
    if settings.mixture is None:
        await _serve_one(settings, stop, on_start=on_start)
        return
    first, *further = source_settings(settings)
    served: dict[str, lifecycle.Sidecar] = {}
    names = [source.name for source in settings.mixture.sources]

    def started(name: str) -> Callable[[lifecycle.Sidecar], None]:
        def note(sidecar: lifecycle.Sidecar) -> None:
            served[name] = sidecar

        return note

    async def gate(sidecar: lifecycle.Sidecar) -> None:
        while not stop.is_set():
            waiting = [
                n for n in names[1:] if n not in served or not served[n].readiness.is_ready()
            ]
            if not waiting:
                sidecar.readiness.open(MIXTURE_GATE, f"all {len(names)} sources ready")
                return
            sidecar.readiness.waiting(MIXTURE_GATE, f"waiting for sources {waiting}")
            await asyncio.sleep(_SOURCES_POLL)

    gates: list[asyncio.Task[None]] = []

    def first_started(sidecar: lifecycle.Sidecar) -> None:
        served[names[0]] = sidecar
        # Per-source series on the scraped port (the further sources' own are not).
        sidecar.metrics.registry.register(
            metrics.MixtureCollector(lambda: {n: s.stats() for n, s in served.items()})
        )
        sidecar.readiness.require(MIXTURE_GATE, f"waiting for sources {names[1:]}")
        gates.append(asyncio.get_running_loop().create_task(gate(sidecar)))
        if on_start is not None:
            on_start(sidecar)

    # Each source's reason to exit, in the order they came: written together once all
    # have stopped, since each one's own write would replace the others'.
    exits: list[str] = []

    async def one(sub: configuration.Settings, name: str, note: Callable[..., None]) -> None:
        try:
            await _serve_one(sub, stop, on_start=note, exits=exits, label=f"source {name}: ")
        except errors.InputError as exc:
            exits.append(f"source {name}: cannot start: {exc}")
            stop.set()  # the others shut down cleanly: the sidecar exits as one
            raise
        except BaseException:
            stop.set()
            raise

    make_directories(settings)
    write_descriptor(first)
    try:
        results = await asyncio.gather(
            one(first, names[0], first_started),
            *(one(sub, name, started(name)) for sub, name in zip(further, names[1:], strict=True)),
            return_exceptions=True,
        )
    finally:
        for task in gates:
            task.cancel()
        if exits:
            termination.write(settings.termination_message_path, termination.joined(exits))
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed and isinstance(failed[0], errors.InputError):
        raise termination.Written("; ".join(str(r) for r in failed)) from failed[0]
    if failed:
        raise failed[0]


async def _serve_one(
    settings: configuration.Settings,
    stop: asyncio.Event,
    *,
    on_start: Callable[[lifecycle.Sidecar], None] | None = None,
    exits: list[str] | None = None,
    label: str = "",
) -> None:
    """One cache server until `stop`. Why it never served goes to the termination
    message, or, given `exits` (one of several servers: `serve`), there, after `label`."""
    # Everything that may refuse the start (a directory, a socket still served, a port
    # in use) comes before anything is written into the directories: a refused start
    # takes back what it made (`remove_made`) and leaves nothing behind.
    made = make_directories(settings)
    try:
        remove_stale_socket(settings.socket_path)
    except errors.InputError:
        remove_made(made)
        raise
    sidecar = lifecycle.Sidecar(settings)
    checkpoints: agent.Agent | None = None
    undone: str | None = None
    # Waiting acquires can take minutes; on SIGTERM they get a few seconds, not the
    # default minute, so the cache closes and the checkpoint agent drains within the
    # pod's grace period.
    runner_options: dict[str, Any] = {
        "access_log": None,
        "handle_signals": False,
        "shutdown_timeout": _SHUTDOWN_TIMEOUT,
    }
    control_runner = web.AppRunner(control_app(sidecar), **runner_options)
    probe_runner = web.AppRunner(probe_app(sidecar), **runner_options)
    ui_runner = web.AppRunner(ui_app(sidecar), **runner_options)
    await control_runner.setup()
    await probe_runner.setup()
    await ui_runner.setup()
    assert control_runner.server is not None  # set up above
    control_server = socket_server.Server(sidecar, control_runner.server)
    started = False
    try:
        await listening.start_tcp(
            probe_runner,
            settings.metrics_host,
            settings.metrics_port,
            port_field="metrics_port",
            host_field="metrics_host",
        )
        await listening.start_tcp(
            ui_runner,
            configuration.UI_HOST,
            settings.ui_port,
            port_field="ui_port",
            host_field=None,
        )
        await control_server.start(settings.socket_path)
        # The trainer may run as another user than the sidecar; the socket lives in
        # the pod's own volume, so the pod boundary is the access boundary.
        os.chmod(settings.socket_path, 0o666)
        _prepare_reader_locks(settings.memory_dir)
        log.info(
            "listening",
            extra={
                "socket": str(settings.socket_path),
                "metrics": f"{settings.metrics_host}:{settings.metrics_port}",
                "ui": f"{configuration.UI_HOST}:{settings.ui_port}",
            },
        )
        sidecar.start()
        started = True
        if settings.checkpoint is not None:
            checkpoints = hook.attach(
                settings.checkpoint, sidecar.readiness, sidecar.metrics.registry
            )
        if on_start is not None:
            # Where other agents (checkpoints) hook in, e.g. to add a readiness gate.
            on_start(sidecar)
        await stop.wait()
        log.info("shutting down")
    finally:
        reason = exit_reason(sidecar) if started else None
        reasons = [] if reason is None else [reason]
        # Written now, before the shutdown that may outlast the grace period.
        _tell(settings, reasons, exits, label)
        await control_server.close(_SHUTDOWN_TIMEOUT)
        await control_runner.cleanup()
        await probe_runner.cleanup()
        await ui_runner.cleanup()
        if checkpoints is not None:
            undone = await hook.detach(checkpoints)
            if undone is not None:
                _tell(settings, [*reasons, undone], exits, label, told=len(reasons))
        await sidecar.close()
        with contextlib.suppress(FileNotFoundError):
            settings.socket_path.unlink()
        if not started:
            remove_made(made)
    if undone is not None:
        raise termination.Unfinished(undone)


def _tell(
    settings: configuration.Settings,
    reasons: list[str],
    exits: list[str] | None,
    label: str,
    *,
    told: int = 0,
) -> None:
    """`reasons` to the termination message, or to `exits` (one of several servers,
    `serve`, writes them all) after `label`; `told` of them are there already."""
    if exits is not None:
        exits.extend(label + reason for reason in reasons[told:])
    elif reasons:
        termination.write(settings.termination_message_path, termination.joined(reasons))


def _prepare_reader_locks(memory_dir: Path) -> None:
    try:
        reader_locks.prepare(memory_dir)
    except OSError as exc:
        # Not fatal: readers are then kept until closed, as without reader locks.
        log.warning(
            "cannot use %s for reader locks (%s): the readers of processes that die are "
            "kept until this sidecar restarts",
            memory_dir / reader_locks.DIRECTORY,
            exc,
        )
