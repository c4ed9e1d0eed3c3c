"""Names and ports for what the injection adds to a pod, never colliding with its own.

A taken name gets a numeric suffix (`-2`, `-3`, ...), a taken port the next free number,
and long names are cut with a hash suffix so they stay valid DNS labels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from shardcache import errors
from shardcache.contract import variables

UI_PORT_ENV = variables.UI_PORT.env

#: Kubernetes limits a port name to 15 characters (an IANA service name).
PORT_NAME_LIMIT = 15
#: The sidecar's name is `shardcache-<mount>` cut to this, leaving room for `-run`,
#: `-disk`, `-ckpt`, `-mfst` and `-cred` volume suffixes within a 63-character DNS label.
BASE_LIMIT = 56


def dns_label(text: str, *, limit: int = 63) -> str:
    """`text` as a DNS label of at most `limit` characters (a hash keeps cut ones unique)."""
    label = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")
    if len(label) <= limit:
        return label
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{label[: limit - 9].rstrip('-')}-{digest}"


def unique(base: str, taken: set[str], *, limit: int = 63) -> str:
    """`base`, or `base-2`, `base-3`, ... whichever is free; recorded in `taken`."""
    candidate, n = base[:limit], 1
    while candidate in taken:
        n += 1
        suffix = f"-{n}"
        candidate = base[: limit - len(suffix)] + suffix
    taken.add(candidate)
    return candidate


_DECIMAL_RE = re.compile(r"[0-9]+")

#: A checkpoint volume's name as `Taken.allocate` gives it: `<base>-ckpt`, maybe `-N`.
_CHECKPOINT_VOLUME_RE = re.compile(r"shardcache-[a-z0-9-]*-ckpt(-[0-9]+)?")


def is_checkpoint_volume(name: str) -> bool:
    """Whether `name` is a checkpoint volume the injection named (a DatasetMount's)."""
    return _CHECKPOINT_VOLUME_RE.fullmatch(name) is not None


def _objects(value: object) -> list[Mapping[str, Any]]:
    """The objects of a list field of a container; none when it is no list. The API
    server refuses such a pod after the webhooks: here it must only not fail (a 500)."""
    if not isinstance(value, list):
        return []
    return [item for item in value if isinstance(item, Mapping)]


@dataclasses.dataclass(frozen=True)
class MountNames:
    """What one mount's injection is called in the pod."""

    sidecar: str
    run_volume: str
    disk_volume: str
    #: None when the mount has no checkpoints.
    checkpoint_volume: str | None
    port: int
    port_name: str
    #: The web inspector's port; loopback only, so it is declared on no container.
    ui_port: int
    #: The volume that hands the sidecar its pinned manifests (`manifest_handoff`);
    #: None when the mount is handed none.
    manifest_volume: str | None = None
    #: The volume of the source's Secret, mounted as files in the sidecar so that a
    #: rotated key reaches it (`pod_volumes.credentials_volume`); None when it has none.
    credentials_volume: str | None = None


class Taken:
    """The names and ports a pod already uses; each allocation adds to them."""

    def __init__(
        self,
        *,
        containers: Sequence[Mapping[str, Any]],
        init_containers: Sequence[Mapping[str, Any]],
        ephemeral: Sequence[Mapping[str, Any]],
        volumes: Sequence[Mapping[str, Any]],
    ) -> None:
        every = [*containers, *init_containers]
        self.containers = {str(c.get("name")) for c in [*every, *ephemeral]}
        self.volumes = {str(v.get("name")) for v in volumes}
        ports = [p for c in every for p in _objects(c.get("ports"))]
        self.ports = {
            int(p["containerPort"]) for p in ports if isinstance(p.get("containerPort"), int)
        }
        self.port_names = {str(p.get("name")) for p in ports}
        # Loopback ports of sidecars injected earlier: declared nowhere but in their env.
        self.ports |= {
            int(e["value"])
            for c in every
            for e in _objects(c.get("env"))
            # ASCII digits: str.isdigit() is true of '²' too, which int() refuses.
            if e.get("name") == UI_PORT_ENV and _DECIMAL_RE.fullmatch(str(e.get("value", "")))
        }

    def port(self, first: int) -> int:
        """`first`, or the next number no container of the pod uses."""
        port = first
        while port in self.ports:
            port += 1
        self.ports.add(port)
        return port

    def free(self, first: int, last: int) -> int:
        """How many ports from `first` to `last` no container of the pod uses."""
        return sum(1 for port in range(first, last + 1) if port not in self.ports)

    def allocate(
        self,
        mount: str,
        *,
        first_port: int,
        first_ui_port: int,
        checkpoints: bool,
        last_port: int | None = None,
        manifests: bool = False,
        credentials: bool = False,
    ) -> MountNames:
        """Names for one mount's sidecar, volumes and port, in a fixed order so that
        injecting the same pod twice gives the same names. The port stays at or below
        `last_port` (the admission leaves out mounts beyond the range's room first,
        `injection.metrics_ports_free`); none left there is an `InputError`.
        `manifests`: whether the mount is handed its pinned manifests (a volume more,
        named after the others so that their names do not depend on it).
        `credentials`: whether the sidecar mounts the source's Secret as files (a volume
        more, named last for the same reason)."""
        base = dns_label(f"shardcache-{mount}", limit=BASE_LIMIT)
        sidecar = unique(base, self.containers)
        run_volume = unique(f"{base}-run", self.volumes)
        disk_volume = unique(f"{base}-disk", self.volumes)
        port = self.port(first_port)
        if last_port is not None and port > last_port:
            raise errors.InputError(
                f"no free port for the sidecar of DatasetMount {mount} in {first_port}-"
                f"{last_port} (the sidecars' probe/metrics range): the pod's containers "
                "and its other sidecars use them all"
            )
        port_name = unique("shardcache", self.port_names, limit=PORT_NAME_LIMIT)
        checkpoint_volume = unique(f"{base}-ckpt", self.volumes) if checkpoints else None
        ui_port = self.port(first_ui_port)
        manifest_volume = unique(f"{base}-mfst", self.volumes) if manifests else None
        credentials_volume = unique(f"{base}-cred", self.volumes) if credentials else None
        return MountNames(
            sidecar,
            run_volume,
            disk_volume,
            checkpoint_volume,
            port,
            port_name,
            ui_port,
            manifest_volume=manifest_volume,
            credentials_volume=credentials_volume,
        )
