"""`shardcache inspect --tui`: page through steps, ranks and epochs in the terminal.

Built on textual, which is imported only here (the `inspect` extra), so the client
library never needs it. Everything painted is a rich `Text` of `render.safe` text: a
plain `str` would be parsed as markup (a value holding `[/]` would crash the viewer),
and rich passes ESC through to the terminal. Keys: n/p (or →/←) step, r/R rank, e/E epoch, g go to a step,
/ search with a --where expression (jumps to where the first match is seen), m next
match, q quit. Errors (a step past the end, a bad expression) show in the status line
and leave the view as it was.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Header, Input, Static

from shardcache import errors
from shardcache.inspect import locate, render, session

_TABLE_OPTIONS = render.RenderOptions(max_chars=48, max_tokens=8, max_turns=3, max_cell_chars=24)
_DETAIL_OPTIONS = render.RenderOptions(max_chars=600, max_tokens=64, max_turns=12)


def label(text: str) -> Text:
    """`text` as painted: escaped, never markup."""
    return Text(render.safe(text))


def summary(cell: dict[str, Any]) -> str:
    """One line per cell for the table (not yet `safe`: `label` it)."""
    kind = cell["kind"]
    if kind == "null":
        return "∅"
    if kind == "text":
        return str(cell["value"]).replace("\n", " ") + ("…" if cell["truncated"] else "")
    if kind == "tokens":
        return f"{cell['length']} tokens"
    if kind == "image":
        return f"{cell['format'].upper()} {cell['width']}x{cell['height']}"
    if kind == "binary":
        return f"{cell['bytes']} bytes"
    if kind == "turns":
        return f"{cell['length']} turns"
    if kind == "struct":
        return "{…}"
    if kind == "list":
        return f"{cell['length']} items"
    return str(cell["value"])


class InspectApp(App[None]):
    TITLE = "shardcache inspect"
    CSS = """
    #status { height: 2; padding: 0 1; background: $boost; }
    #samples { height: 1fr; }
    #detail { height: 1fr; padding: 0 1; border-top: solid $primary; overflow-y: auto; }
    #prompt.hidden { display: none; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("n,right", "move_step(1)", "next step"),
        Binding("p,left", "move_step(-1)", "prev step"),
        Binding("r", "move_rank(1)", "next rank"),
        Binding("R", "move_rank(-1)", "prev rank"),
        Binding("e", "move_epoch(1)", "next epoch"),
        Binding("E", "move_epoch(-1)", "prev epoch"),
        Binding("g", "ask('step')", "go to step"),
        Binding("slash", "ask('search')", "search"),
        Binding("m", "next_match", "next match"),
        Binding("escape", "dismiss_prompt", show=False),
        Binding("q", "quit", "quit"),
    ]

    def __init__(
        self,
        inspector: session.Inspector,
        query: locate.Query,
        *,
        columns: list[str] | None = None,
        decode: render.Decode | None = None,
        batch_size_assumed: bool = False,
    ) -> None:
        super().__init__()
        #: The batch size is the default, not the run's: the status line says so.
        self.batch_size_assumed = batch_size_assumed
        self.inspector = inspector
        self.current = query
        self.columns = inspector.columns(columns)
        self.decode = decode
        self.data: dict[str, Any] = {}
        self._detail: dict[str, Any] = {}
        self.message = ""
        self._asking = ""
        self._matches: list[locate.Sighting] = []
        self._match = 0

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status", markup=False)
        yield DataTable(id="samples", cursor_type="row", zebra_stripes=True)
        yield Static(id="detail", markup=False)
        yield Input(id="prompt", classes="hidden")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#samples", DataTable)
        table.add_columns(*(label(c) for c in ("#", "index", "shard", "row", *self.columns)))
        if not self.show(self.current):
            self._update_status()

    # --- view ---------------------------------------------------------------------
    def show(self, query: locate.Query) -> bool:
        """Load `query`; on an error keep the current view and say why."""
        try:
            view = self.inspector.step(query, self.columns)
        except errors.InputError as exc:
            self.message = str(exc)
            self._update_status()
            return False
        self.current = query
        self.data = session.step_json(
            view, self.inspector.manifest, options=_TABLE_OPTIONS, decode=self.decode
        )
        self._detail = session.step_json(
            view, self.inspector.manifest, options=_DETAIL_OPTIONS, decode=self.decode
        )
        table = self.query_one("#samples", DataTable)
        table.clear()
        for slot, sample in enumerate(self.data["samples"]):
            p = sample["provenance"]
            cells = [summary(sample["values"][c]) for c in self.columns]
            row = (str(slot), str(p["index"]), p["shard"], str(p["row"]), *cells)
            table.add_row(*(label(c) for c in row))
        self.message = ""
        self._update_status()
        self._show_detail(0)
        return True

    def _update_status(self) -> None:
        q = self.current
        head = (
            f"epoch {q.epoch} · rank {q.rank}/{q.world_size} · step {q.step}"
            f" of {self.data.get('steps', '?')} · batch size {q.batch_size}"
            + (" (assumed: --batch-size gives the run's)" if self.batch_size_assumed else "")
            + f" · seed {q.seed}"
        )
        self.query_one("#status", Static).update(
            Text(head + ("\n" + render.safe(self.message) if self.message else ""))
        )

    def _show_detail(self, slot: int) -> None:
        samples = self._detail["samples"] if self.data else []
        if not 0 <= slot < len(samples):
            self.query_one("#detail", Static).update("")
            return
        sample = samples[slot]
        p = sample["provenance"]
        lines = [f"[{slot}] index {p['index']} · shard {p['shard']} row {p['row']}"]
        width = max(len(render.safe(c)) for c in self.columns)
        for name, cell in sample["values"].items():
            body = render.cell_text(cell, indent=" " * (width + 4))
            lines.append(f"  {render.safe(name).ljust(width)}  {body[0]}")
            lines.extend(body[1:])
        self.query_one("#detail", Static).update(
            Text("\n".join(render.safe(line) for line in lines))
        )

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.cursor_row)

    # --- actions ------------------------------------------------------------------
    def _try(self, **changes: int) -> None:
        try:
            query = self.current.replace(**changes)
        except errors.InputError as exc:
            self.message = str(exc)
            self._update_status()
            return
        self.show(query)

    def action_move_step(self, delta: int) -> None:
        self._try(step=self.current.step + delta)

    def action_move_rank(self, delta: int) -> None:
        # Same step on another rank: the ranks of a job take their steps together.
        self._try(rank=(self.current.rank + delta) % self.current.world_size)

    def action_move_epoch(self, delta: int) -> None:
        self._try(epoch=self.current.epoch + delta)

    def action_ask(self, what: str) -> None:
        self._asking = what
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = "step number" if what == "step" else "where, e.g. uid == 123"
        prompt.value = ""
        prompt.remove_class("hidden")
        prompt.focus()

    def action_dismiss_prompt(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.add_class("hidden")
        self.query_one("#samples", DataTable).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        self.action_dismiss_prompt()
        if self._asking == "step":
            try:
                step = int(text)
            except ValueError:
                self.message = f"expected a step number, found {text!r}"
                self._update_status()
                return
            self._try(step=step)
        elif self._asking == "search":
            self.search(text)

    def search(self, expression: str) -> None:
        try:
            result = self.inspector.where(expression, self.current)
        except errors.InputError as exc:
            self.message = str(exc)
            self._update_status()
            return
        self._matches = result.sightings
        self._match = 0
        if not self._matches:
            self.message = f"no sample matches {expression!r}"
            self._update_status()
            return
        self._go_to_match()

    def action_next_match(self) -> None:
        if self._matches:
            self._match = (self._match + 1) % len(self._matches)
            self._go_to_match()

    def _go_to_match(self) -> None:
        s = self._matches[self._match]
        if s.rank is None or s.step is None or s.slot is None:
            # Only a run's states (not taken with --tui) leave a sample without a rank.
            return
        if self.show(self.current.replace(epoch=s.epoch, rank=s.rank, step=s.step)):
            self.query_one("#samples", DataTable).move_cursor(row=s.slot)
            self._show_detail(s.slot)
            self.message = (
                f"match {self._match + 1} of {len(self._matches)}: index {s.index} "
                f"is row {s.slot} of this batch (m: next match)"
            )
            self._update_status()
