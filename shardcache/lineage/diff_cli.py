"""`shardcache diff`: the first step and rank where two runs' batches differ, and why.

Each plan option comes in three spellings: `--seed 3` sets both runs, `--a-seed` and
`--b-seed` one run. `--a-checkpoint-uri` (or `--b-…`) reads a run's plan, batch size and
skips from the data states it published, which then win over the shared options; a
run whose checkpoints changed world size (an elastic resume) is compared generation by
generation (`shardcache.lineage.diff`), each at the batch size its checkpoints record
(the run's, given or its first generation's, where they record none).
Silent, with exit status 0, when the runs' data is identical; 1 when it differs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardcache import errors, manifests, plans
from shardcache.lineage import diff, failures, published

#: (option, type, default) of the plan options each run has.
_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("seed", int, 0),
    ("world-size", int, 1),
    ("batch-size", int, 32),
    ("block-size", int, plans.DEFAULT_BLOCK_SIZE),
    ("shuffle", str, "on"),
    ("window", int, plans.DEFAULT_WINDOW),
    ("digest", str, None),
    ("checkpoint-uri", published.uri_argument, None),
)

#: --shuffle's spellings, as `shardcache.open(shuffle=…)` values.
_SHUFFLES: dict[str, bool | str] = {
    "on": True,
    "off": False,
    plans.BLOCK: plans.BLOCK,
    plans.SAMPLE: plans.SAMPLE,
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "diff",
        help="the first step and rank where two runs' data differ, and why",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=(
            "Each option X is --X (both runs), --a-X or --b-X (one run). --shuffle takes "
            "on (= block), block, sample or off; --window is sample mode's; --digest pins the dataset a run must resolve to."
        ),
    )
    p.add_argument("uri", help="run A's dataset URI (and run B's unless URI_B is given)")
    p.add_argument("uri_b", nargs="?", metavar="URI_B", help="run B's dataset URI")
    for name, kind, _ in _OPTIONS:
        dest = name.replace("-", "_")
        p.add_argument(f"--{name}", dest=dest, type=kind)
        p.add_argument(f"--a-{name}", dest=f"a_{dest}", type=kind, help=argparse.SUPPRESS)
        p.add_argument(f"--b-{name}", dest=f"b_{dest}", type=kind, help=argparse.SUPPRESS)
    p.add_argument(
        "--epochs",
        type=int,
        help="epochs compared from 0 (default 1, or up to the newest checkpoint's epoch)",
    )
    p.add_argument(
        "--cache-dir",
        help="taken as `inspect`, `lineage` and `web` take it, so their command lines "
        "carry over; diff compares samples by identity and reads no shard data, so "
        "nothing is cached there",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (errors.ShardcacheError, OSError) as exc:
        return failures.report("diff", exc)


def _value(args: argparse.Namespace, side: str, name: str) -> Any:
    dest = name.replace("-", "_")
    own = getattr(args, f"{side}_{dest}")
    return own if own is not None else getattr(args, dest)


def _flag(args: argparse.Namespace, side: str, name: str) -> str:
    """The option that gave run `side` its value of `name`, as the user typed it:
    `--a-seed` when set for that run alone, else the shared `--seed`."""
    own = getattr(args, f"{side}_{name.replace('-', '_')}")
    return f"--{side}-{name}" if own is not None else f"--{name}"


def side_plan(
    args: argparse.Namespace, side: str, manifest: manifests.Manifest
) -> tuple[diff.RunPlan, int]:
    """Run `side`'s plan, and the newest epoch its checkpoints reached (0 without)."""
    values = {
        name: (v if (v := _value(args, side, name)) is not None else default)
        for name, _, default in _OPTIONS
    }
    digest = values["digest"]
    if digest is not None and digest != manifest.digest:
        raise errors.ManifestMismatchError(
            f"run {side.upper()}: the dataset resolves to {manifest.digest}, but "
            f"{_flag(args, side, 'digest')} pins {digest}: the dataset changed"
        )
    if values["shuffle"] not in _SHUFFLES:
        raise errors.InputError(
            f"{_flag(args, side, 'shuffle')}: expected one of {', '.join(_SHUFFLES)}, "
            f"found {values['shuffle']!r}"
        )
    shuffle, granularity = plans.shuffle_mode(_SHUFFLES[values["shuffle"]])
    for name in ("world-size", "batch-size", "block-size", "window"):
        if values[name] < 1:
            raise errors.InputError(f"{_flag(args, side, name)} must be >= 1, got {values[name]}")
    params = plans.PlanParams(
        seed=values["seed"],
        world_size=values["world-size"],
        shuffle=shuffle,
        granularity=granularity,
        block_size=values["block-size"],
        window=values["window"],
    )
    batch_size = values["batch-size"]
    uri = values["checkpoint-uri"]
    if uri is None:
        return diff.RunPlan(manifest, params, batch_size), 0
    hist = published.history_of(manifest, uri)
    elastic = len(hist.generations) > 1
    # The options name the run's start: its first generation's plan and batch size.
    first = hist.generations[0]
    for name, given, found in (
        ("seed", getattr(args, f"{side}_seed"), hist.params.seed),
        ("world-size", getattr(args, f"{side}_world_size"), hist.params.world_size),
        ("batch-size", getattr(args, f"{side}_batch_size"), first.batch_size(0)),
    ):
        if given is not None and found is not None and given != found:
            # An elastic run's later world sizes come from its resizes: the option
            # (like a plan-only run's) names the one it started at.
            which = (
                ", its first generation's world size" if elastic and name == "world-size" else ""
            )
            raise errors.InputError(
                f"--{side}-{name} {given} contradicts run {side.upper()}'s checkpoints "
                f"({found}{which}): leave it out"
            )
    recorded = first.batch_size(0)
    size = recorded if recorded is not None else batch_size
    if elastic:
        # Each generation carries its own plans (segments), per-pass skips and batch
        # size; `size` is for a generation whose checkpoints record none.
        plan = diff.RunPlan(manifest, hist.params, size, generations=hist.generations)
    else:
        plan = diff.RunPlan(
            manifest,
            hist.params,
            size,
            {r: [s for _, s in hist.skips(r)] for r in first.chains},
            {r: again for r in first.chains if (again := hist.read_again(r))},
        )
    newest = max(
        state.epoch for g in hist.generations for r in g.chains if (state := g.last(r)) is not None
    )
    return plan, newest


def _run(args: argparse.Namespace) -> int:
    manifest_a = manifests.resolve(args.uri)
    manifest_b = manifests.resolve(args.uri_b) if args.uri_b else manifest_a
    a, epoch_a = side_plan(args, "a", manifest_a)
    b, epoch_b = side_plan(args, "b", manifest_b)
    epochs = args.epochs if args.epochs is not None else max(epoch_a, epoch_b) + 1
    if epochs < 1:
        raise errors.InputError(f"--epochs must be >= 1, got {epochs}")
    found = diff.first_difference(a, b, range(epochs))
    if found is None:
        if args.json:
            print(json.dumps({"identical": True, "epochs": epochs}))
        return 0
    data = {"identical": False, "epochs": epochs, **found.to_json()}
    print(json.dumps(data, indent=2) if args.json else text(data))
    return 1


def text(data: dict[str, Any]) -> str:
    passes = data.get("passes", 1)
    where = f" pass {data.get('pass_index', 0) + 1} of {passes}" if passes > 1 else ""
    lines = [
        f"first difference: epoch {data['epoch']}{where} step {data['step']} rank {data['rank']}",
    ]
    if any(f"generation_{side}" in data for side in ("a", "b")):
        # Only a comparison where either run resized names generations.
        lines.append("  in " + ", ".join(_generation_text(data, side) for side in ("a", "b")))
    lines += [f"  because of {r}" for r in data["reasons"]]
    for side in ("a", "b"):
        samples = data[side]
        shown = ", ".join(f"{path}:{row}" for path, row in samples[:4])
        more = f" … ({len(samples)} samples)" if len(samples) > 4 else ""
        lines.append(f"  run {side.upper()} reads {shown or 'nothing'}{more}")
    return "\n".join(lines)


def _generation_text(data: dict[str, Any], side: str) -> str:
    """Run `side`'s generation at the difference, with its world size and, where the
    runs' generations do not all share one batch size, its batch size."""
    if data.get(f"generation_{side}") is None:
        return f"no generation of run {side.upper()}"
    size = f", batch size {data[f'batch_size_{side}']}" if f"batch_size_{side}" in data else ""
    return (
        f"run {side.upper()}'s generation {data[f'generation_{side}']} "
        f"(world size {data[f'world_size_{side}']}{size})"
    )
