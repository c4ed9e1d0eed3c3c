"""`shardcache inspect`: print the samples a rank receives at a step, or where a sample
is seen (`--where`), or page through them (`--tui`)."""

from __future__ import annotations

import argparse
import json
import sys

from shardcache import errors, plans, states
from shardcache.inspect import locate, render, session
from shardcache.lineage import published

#: Samples per step when neither --batch-size nor a data state says.
DEFAULT_BATCH_SIZE = 32
#: Where the batch size of a step came from, as the output says it
#: (`batch_size_from`): step N means other samples at another batch size, so an
#: assumed one is said.
FROM_FLAG, FROM_STATE, FROM_DEFAULT = "--batch-size", "--data-state", session.BATCH_SIZE_ASSUMED
#: The batch size the followed run's checkpoints record (`--checkpoint-uri`).
FROM_RUN = "--checkpoint-uri"


def batch_size_from(args: argparse.Namespace, recorded: int | None) -> str:
    """Where the query's batch size comes from: the flag, the run's data states (given
    as files, or read from its checkpoints), or assumed (`DEFAULT_BATCH_SIZE`: nothing
    given says the run's)."""
    if args.batch_size is not None:
        return FROM_FLAG
    if recorded is None:
        return FROM_DEFAULT
    return FROM_RUN if args.checkpoint_uri is not None else FROM_STATE


def _names(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def add_plan_arguments(
    parser: argparse.ArgumentParser,
    *,
    batch_size: int | None = DEFAULT_BATCH_SIZE,
    recorded_by: str = "--data-state",
) -> None:
    """The reading-plan options, shared with `shardcache web`; `batch_size` is
    --batch-size's default (None: decided later, from the run's data states, which the
    option `recorded_by` gives)."""
    g = parser.add_argument_group("reading plan (as the training job uses it)")
    g.add_argument("--world-size", type=int, default=1, help="ranks in the job (default 1)")
    g.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    g.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=f"samples per step (default {DEFAULT_BATCH_SIZE}"
        + (f", or the one {recorded_by} records)" if batch_size is None else ")"),
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=plans.DEFAULT_BLOCK_SIZE,
        help=f"rows per shuffle block (default {plans.DEFAULT_BLOCK_SIZE})",
    )
    g.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="manifest order")
    g.add_argument(
        "--granularity",
        choices=plans.GRANULARITIES,
        default=plans.BLOCK,
        help='what the shuffle permutes: "block" (shuffle=True, the default) or "sample" '
        '(shuffle="sample": rows within windows, plan version 2)',
    )
    g.add_argument(
        "--window",
        type=int,
        default=plans.DEFAULT_WINDOW,
        help=f"rows per sample-shuffle window (default {plans.DEFAULT_WINDOW})",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show exactly the samples a rank receives at a step",
        description=(
            "Print exactly the samples rank R receives at step N of epoch E (step N is "
            "batch N of Dataset.batches(B), counting from 0), with provenance: shard, "
            "row in the shard, global sample index."
        ),
    )
    p.add_argument("uri", nargs="?", help="dataset URI (file://, s3://, ...)")
    p.add_argument("--mount", help="the sidecar's DatasetMount instead of a URI (in a pod)")
    p.add_argument("--cache-dir", help="embedded cache directory (default ~/.cache/shardcache)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--step", type=int, default=0, help="batch number in the epoch, from 0")
    add_plan_arguments(p, batch_size=None)
    p.add_argument(
        "--columns",
        type=_names,
        action="extend",
        help="comma-separated columns to show (default all)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tokenizer", help="a HuggingFace tokenizer.json to decode token ids")
    p.add_argument("--max-chars", type=int, default=200, help="text shown per cell (0: all)")
    p.add_argument(
        "--where",
        metavar="EXPR",
        help="reverse lookup: at which (epoch, rank, step) are samples matching EXPR seen, "
        "e.g. 'uid == 123'",
    )
    p.add_argument(
        "--pass",
        dest="pass_number",
        type=int,
        default=None,
        help="with --checkpoint-uri, an epoch the run read more than once: which pass over "
        "--epoch to show, from 1 (default: the newest), with that pass's skips",
    )
    p.add_argument("--epochs", type=int, default=1, help="with --where: epochs from --epoch")
    p.add_argument("--limit", type=int, default=100, help="with --where: most samples reported")
    p.add_argument(
        "--data-state",
        metavar="FILE",
        action="append",
        default=[],
        help="a rank's saved data state (a state dict, a checkpoint's .shardcache-commit "
        "marker or its checkpoint.json), one per rank, of the plan given: steps then follow "
        "the rank's stream as it read it (its elastic-resume segments, only the batches "
        "it was handed), and --where marks the samples it skipped",
    )
    p.add_argument(
        "--checkpoint-uri",
        type=published.uri_argument,
        help="where the run publishes its checkpoints (spec.checkpoint.uri), as for "
        "`shardcache web`: steps and --where follow each rank's newest published data "
        "state of the plan given (its skips, its resumed ranks' segments), at the batch "
        "size it records unless --batch-size says otherwise",
    )
    p.add_argument("--tui", action="store_true", help="interactive terminal UI (textual)")
    p.set_defaults(func=run)


def query_from(args: argparse.Namespace, *, batch_size: int | None = None) -> locate.Query:
    """The query the arguments give; `batch_size` when --batch-size was not given (the
    run's, from its data states)."""
    size = args.batch_size if args.batch_size is not None else batch_size
    return locate.Query(
        epoch=args.epoch,
        rank=args.rank,
        world_size=args.world_size,
        step=args.step,
        batch_size=size if size is not None else DEFAULT_BATCH_SIZE,
        seed=args.seed,
        shuffle=args.shuffle,
        block_size=args.block_size,
        granularity=args.granularity,
        window=args.window,
    )


def load_states(paths: list[str]) -> dict[int, tuple[str, states.DataState]]:
    """{rank: (path, state)} from saved data states, in any of the files that carry one."""
    out: dict[int, tuple[str, states.DataState]] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise errors.InputError(f"--data-state {path}: cannot read it as JSON: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("data_state"), dict):
            data = data["data_state"]  # a commit marker or a checkpoint manifest
        state = states.parse(data, where=f"--data-state {path}")
        if state.rank in out:
            raise errors.InputError(
                f"--data-state: two states of rank {state.rank} ({out[state.rank][0]} and {path})"
            )
        out[state.rank] = (path, state)
    return out


def recorded_batch_size(
    loaded: dict[int, tuple[str, states.DataState]], *, flag: str = "--data-state"
) -> int | None:
    """The batch size the states record (None when none does): step N is a batch of
    it. States that record different ones are not of one run. `flag` is the option
    the states came from, named in the error."""
    sizes = {path: s.batch_size for path, s in loaded.values() if s.batch_size is not None}
    if len(set(sizes.values())) > 1:
        raise errors.StateMismatchError(
            f"{flag}: the states record different batch sizes "
            f"({', '.join(f'{p}: {b}' for p, b in sizes.items())}): expected the states of "
            "one run"
        )
    return next(iter(sizes.values()), None)


def check_states(
    loaded: dict[int, tuple[str, states.DataState]],
    digest: str,
    query: locate.Query,
    *,
    flag: str = "--data-state",
) -> dict[int, states.DataState]:
    """The states by rank, each refused unless saved under the dataset (`digest`) and
    plan the command was given: a state's positions mean other rows in another plan.
    `flag` is the option the states came from (--data-state or --checkpoint-uri), so
    the error names the one the user gave."""
    for path, state in loaded.values():
        differ = locate.state_mismatches(digest, query, state)
        if differ:
            raise errors.StateMismatchError(
                f"{flag} {path}: the state was saved under another dataset or plan "
                f"than the one inspected ({'; '.join(differ)}): give the run's dataset and "
                "its plan options (--world-size, --seed, --block-size, --no-shuffle, "
                "--granularity, --window, and --batch-size or none to take the state's)"
            )
    return {rank: state for rank, (_, state) in loaded.items()}


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except errors.InputError as exc:
        print(f"shardcache inspect: {render.safe_lines(str(exc))}", file=sys.stderr)
        return 2
    except errors.ShardcacheError as exc:
        print(f"shardcache inspect: {render.safe_lines(str(exc))}", file=sys.stderr)
        return 1


def pass_index(args: argparse.Namespace) -> int | None:
    """`--pass` as the run's pass index (0 the first); None for the newest."""
    number: int | None = args.pass_number
    if number is None:
        return None
    if args.checkpoint_uri is None:
        raise errors.InputError(
            "--pass selects a pass of the run followed with --checkpoint-uri: expected "
            "--checkpoint-uri, found none"
        )
    if number < 1:
        raise errors.InputError(f"--pass counts from 1: expected >= 1, found {number}")
    return number - 1


def followed_states(
    inspector: session.Inspector, args: argparse.Namespace
) -> dict[int, tuple[str, states.DataState]]:
    """The run at `--checkpoint-uri`, as `load_states` gives states: each rank's newest
    data state in the generation of the plan given (any batch size: the run's is read
    from them), as the web inspector follows a run. A note on stderr says what was
    left out, or that no checkpoint has this plan (steps then follow the plan)."""
    uri = args.checkpoint_uri
    stateless: list[str] = []
    hist = published.history_of(inspector.manifest, uri, stateless=stateless)
    if stateless:
        print(
            f"note: --checkpoint-uri: left out {len(stateless)} checkpoint(s) without a data "
            f"state (model only): {', '.join(stateless[:5])}"
            + (", …" if len(stateless) > 5 else ""),
            file=sys.stderr,
        )
    view = query_from(args)
    chosen = pass_index(args)
    found = hist.newest_states(view.params(), view.epoch, chosen)
    note = hist.pass_note(view.params(), view.epoch, chosen)
    if note:
        print(f"note: --checkpoint-uri: {note}", file=sys.stderr)
    if not found:
        worlds = sorted({g.world_size for g in hist.generations})
        print(
            f"note: --checkpoint-uri: the run's checkpoints have no data state of the plan "
            f"given (its world sizes: {worlds}, seed {hist.params.seed}, block size "
            f"{hist.params.block_size}): steps follow the plan",
            file=sys.stderr,
        )
    return {rank: (f"{uri} (rank {rank})", state) for rank, state in found.items()}


def _run(args: argparse.Namespace) -> int:
    if args.checkpoint_uri is not None and args.data_state:
        raise errors.InputError(
            "expected --data-state files or --checkpoint-uri (the run's newest states), found both"
        )
    pass_index(args)  # a bad --pass is refused before the dataset is opened
    loaded = load_states(args.data_state)
    recorded = recorded_batch_size(loaded)
    query = query_from(args, batch_size=recorded)
    origin = batch_size_from(args, recorded)
    if args.max_chars < 0:
        raise errors.InputError(f"--max-chars must be >= 0, got {args.max_chars}")
    if args.where is not None and args.limit < 1:
        raise errors.InputError(f"--limit must be >= 1, got {args.limit}")
    decode = render.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if (loaded or args.checkpoint_uri is not None) and args.tui:
        raise errors.InputError(
            "--data-state and --checkpoint-uri are not supported with --tui yet"
        )
    inspector = session.open_uri(args.uri, mount=args.mount, cache_dir=args.cache_dir)
    flag = "--data-state"
    try:
        if args.checkpoint_uri is not None:
            flag = "--checkpoint-uri"
            loaded = followed_states(inspector, args)
            recorded = recorded_batch_size(loaded, flag=flag)
            query = query_from(args, batch_size=recorded)
            origin = batch_size_from(args, recorded)
        run = check_states(loaded, inspector.manifest.digest, query, flag=flag)
        columns = inspector.columns(args.columns)
        if args.tui:
            from shardcache.inspect import tui

            tui.InspectApp(
                inspector,
                query,
                columns=columns,
                decode=decode,
                batch_size_assumed=origin == FROM_DEFAULT,
            ).run()
            return 0
        if args.where is not None:
            result = inspector.where(
                args.where, query, epochs=args.epochs, limit=args.limit, run=run
            )
            data = session.where_json(result)
            data["batch_size_from"] = origin
            print(
                render.safe_json(json.dumps(data, indent=2, ensure_ascii=False))
                if args.json
                else session.where_text(data, query)
            )
            return 0 if result.indices else 1
        view = inspector.step(query, columns, run=run)
        if args.json:
            options = render.FULL
        else:
            limit = args.max_chars or None
            options = render.RenderOptions(max_chars=limit)
        data = session.step_json(view, inspector.manifest, options=options, decode=decode)
        data["batch_size_from"] = origin
        print(
            render.safe_json(json.dumps(data, indent=2, ensure_ascii=False))
            if args.json
            else session.step_text(data)
        )
        return 0
    finally:
        inspector.close()
