"""Every question the wizard asks goes through ``Asker``: a flag answers it, ``--yes`` takes its default,
otherwise questionary asks it on the terminal.

One place decides where an answer comes from, so each question exists once (its text, its one-line
explanation, its default and its check) and the interactive and the non-interactive wizard cannot drift
apart. A flag's value passes the same check as a typed answer; a bad one is a one-line ``UserError``
naming the flag. Questions use questionary's ``unsafe_ask``: Ctrl-C raises ``KeyboardInterrupt`` (the
CLI exits 130) instead of returning None as ``ask`` would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

# A check returns None when the text is acceptable, else the reason it is not (shown under the prompt).
Check = Callable[[str], "str | None"]


V = TypeVar("V")


@dataclass(frozen=True)
class Option(Generic[V]):
    """One answer of a multiple-choice question: what is shown and the value it stands for."""

    title: str
    value: V


class Asker:
    """Asks on the terminal, or answers from a flag or from the default (``assume_yes``)."""

    def __init__(self, console: Console, assume_yes: bool = False) -> None:
        self.console = console
        self.assume_yes = assume_yes

    # ---- output ----------------------------------------------------------------------------------

    def say(self, text: str = "", style: str | None = None, soft_wrap: bool = False, markup: bool = False) -> None:
        """Plain text unless ``markup`` (paths may hold ``[...]``); ``soft_wrap``: no line breaks inserted, so
        a command line stays one line when copied."""
        self.console.print(text, style=style, highlight=False, soft_wrap=soft_wrap, markup=markup)

    def _explain(self, explanation: str) -> None:
        if explanation:
            self.console.print(f"  [dim]{explanation}[/dim]", highlight=False)

    def _answered(self, message: str, shown: str, source: str) -> None:
        from rich.markup import escape

        self.console.print(f"[green]?[/green] {escape(message)} [bold]{escape(shown)}[/bold] [dim]({source})[/dim]",
                           highlight=False)

    # ---- questions -------------------------------------------------------------------------------

    def choose(self, message: str, options: Sequence[Option[V]], *, default: V, explanation: str = "",
               flag: str | None = None, given: V | None = None) -> V:
        """One of ``options`` (by value); ``given`` must be one of their values."""
        values = [option.value for option in options]
        if default not in values:
            raise ValueError(f"default {default!r} is not among the options of {message!r}")
        title_of = {repr(option.value): option.title for option in options}
        if given is not None:
            if given not in values:
                raise UserError(f"{flag} {given}: not a choice here; choose one of "
                                + ", ".join(str(v) for v in values))
            self._answered(message, title_of[repr(given)], f"from {flag}")
            return given
        if self.assume_yes:
            self._answered(message, title_of[repr(default)], "default, --yes")
            return default
        import questionary

        self._explain(explanation)
        choices = [questionary.Choice(option.title, value=index) for index, option in enumerate(options)]
        index = questionary.select(message, choices=choices, default=choices[values.index(default)]).unsafe_ask()
        return options[index].value

    def text(self, message: str, *, default: str, explanation: str = "", check: Check | None = None,
             flag: str | None = None, given: str | None = None, path: bool = False,
             only_directories: bool = False) -> str:
        """Free text (a path with completion when ``path``), re-asked until ``check`` accepts it."""
        if given is not None or self.assume_yes:
            value, source = (given, f"from {flag}") if given is not None else (default, "default, --yes")
            problem = check(value) if check is not None else None
            if problem:
                where = flag if given is not None else f"--yes took the default of {flag}"
                raise UserError(f"{where} {value!r}: {problem}")
            self._answered(message, value, source)
            return value
        import questionary

        self._explain(explanation)

        def validate(text: str) -> bool | str:
            problem = check(text) if check is not None else None
            return problem or True

        extra: dict[str, Any] = {}
        if path:
            # Tab completes; Enter always answers (questionary.path's Enter first closes an open completion
            # menu, and its "/" opens one, so typing a path and Enter would not answer).
            from prompt_toolkit.completion import PathCompleter

            extra = {"completer": PathCompleter(only_directories=only_directories, expanduser=True),
                     "complete_while_typing": False, "instruction": "(Tab completes)"}
        question = questionary.text(message, default=default, validate=validate, **extra)
        return str(question.unsafe_ask()).strip()

    def confirm(self, message: str, *, default: bool, explanation: str = "", flag: str | None = None,
                given: bool | None = None) -> bool:
        if given is not None:
            self._answered(message, "yes" if given else "no", f"from {flag}")
            return given
        if self.assume_yes:
            self._answered(message, "yes" if default else "no", "default, --yes")
            return default
        import questionary

        self._explain(explanation)
        return bool(questionary.confirm(message, default=default).unsafe_ask())


def integer_check(low: int, high: int | None = None, multiple_of: int = 1) -> Check:
    """A check for a whole number in [low, high] that is a multiple of ``multiple_of``."""

    def check(text: str) -> str | None:
        try:
            value = int(text.strip())
        except ValueError:
            return "type a whole number"
        if value < low or (high is not None and value > high):
            return f"must be {low} or more" if high is None else f"must be between {low} and {high}"
        if value % multiple_of:
            return f"must be a multiple of {multiple_of}"
        return None

    return check
