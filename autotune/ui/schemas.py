"""The web app's request bodies as validated data: one pydantic model per command, made from that command's own
argparse options, so the API and the CLI cannot drift apart and a body is never re-parsed as a command line.

A body key is an option's long name with ``_`` for ``-`` (``{"dataset": ..., "model": "builtin:tiny-sd15",
"vram": 12, "rank": 16, "clip_l": FILE}``); only those keys, each with its type: an option that takes a number
takes a JSON number within bounds, a choice one of its choices, a flag a boolean, a repeatable option a value or
a list of values, anything else one string of bounded length without control characters. Path fields are
strings checked against the allowed folders. The validated object becomes the ``argparse.Namespace`` the command's
parser would have produced (its defaults, then these values through the option's own converter), which the
command's function takes as it takes the CLI's; a run, a process of its own, gets the validated values in a file
and builds the same namespace there (start_run.py): no command line is ever made from a body.

The models are built from argparse's actions (no hand-written copy): ``--gpu``'s list, ``--optimizer``'s choices
and every model-file key come from where the CLI defines them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

from autotune.launch.user_settings import PATH_SETTINGS, setting_dest
from autotune.layout import is_run_name

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_TEXT = 4096  # characters in one string value (a path, a card's name)
MAX_ITEMS = 16  # values of one repeatable option (--gpu, --vram, --network-arg)
MAX_INT = 2**31 - 1
MAX_NUMBER = 1e12
# options a page never sets, each with the reason said when a body names one
NOT_FROM_THE_PAGE = {"out": "the server names each run's folder under --runs (the API plans without writing)",
                     "resume": "resume a run with POST /api/runs/{id}/resume",
                     "resume_changed": "resume a run with POST /api/runs/{id}/resume",
                     "python": "an engine's Python is autotune ui's --python or the picked checkout's venv",
                     "engine": "choose an engine by its name (autotune ui --engine, or POST /api/engines)",
                     "json": "the API always answers JSON", "html": "the API answers JSON; autotune report writes "
                     "HTML", "help": "see autotune COMMAND --help"}
RUN_GROUP = "the run"  # ``autotune run``'s own options (retries, stall timeout, your config), in no plan group
# the options that name a file or folder (+ the model-file keys): checked against the allowed folders
PATH_DESTS = ("dataset", "model", "config", "dataset_config", *(setting_dest(key) for key in PATH_SETTINGS))


def _plain_text(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("a control character in a text value")
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("give a finite number")
    return value


def _run_name(value: str) -> str:
    if not is_run_name(value):
        raise ValueError("a folder name for the run: letters, digits, '.', '_', '-' (no '..'), up to 128")
    return value


RunName = Annotated[StrictStr, AfterValidator(_run_name)]  # a run's folder name, checked once
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT), AfterValidator(_plain_text)]
Integer = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]
Number = Annotated[StrictInt | StrictFloat, Field(ge=-MAX_NUMBER, le=MAX_NUMBER), AfterValidator(_finite)]


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


def _value_type(action: argparse.Action) -> Any:
    """The JSON type of one value of ``action``."""
    if action.choices is not None:
        return Literal[tuple(action.choices)]
    if action.type is int or getattr(action.type, "__name__", "") == "integer":
        return Integer
    converter = getattr(action.type, "__name__", "")
    if converter == "finite number":
        return Number
    if converter == "resolution":  # 768 or kohya's "768,768"
        return Integer | Text
    return Text


def _field_type(action: argparse.Action) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        return StrictBool
    one = _value_type(action)
    if isinstance(action, argparse._AppendAction):
        return Annotated[list[one], Field(max_length=MAX_ITEMS), BeforeValidator(_as_list)]  # type: ignore[valid-type]
    return one


def body_key(action: argparse.Action) -> str:
    """The body key of an option: its first long name with ``_`` for ``-`` (``--clip_l`` -> clip_l,
    ``--dataset-config`` -> dataset_config); a positional's dest."""
    longs = [option for option in action.option_strings if option.startswith("--")]
    return longs[0][2:].replace("-", "_") if longs else action.dest


@dataclass(frozen=True)
class CommandSchema:
    """One command's body model and how its keys map back to argparse: ``actions`` by body key."""

    command: str
    model: type[BaseModel]
    actions: dict[str, argparse.Action]
    defaults: dict[str, Any]
    groups: dict[str, str]  # body key -> the title of the option's group in ``--help`` (plan_options' groups)

    def validate(self, body: Any) -> BaseModel:
        """``body`` as the model, or ``BadBody`` with one line naming the first wrong key."""
        if not isinstance(body, dict):
            raise BadBody("the request body must be one JSON object of the command's options")
        for key in body:
            if key in NOT_FROM_THE_PAGE and key not in self.model.model_fields:
                raise BadBody(f"{key}: {NOT_FROM_THE_PAGE[key]}")
        try:
            return self.model.model_validate(body)
        except ValidationError as error:
            raise BadBody(describe(error, self)) from None

    def path_keys(self) -> list[str]:
        from autotune.planning.profiles import model_file_keys

        files = set(model_file_keys())
        return [key for key, action in self.actions.items() if action.dest in PATH_DESTS or key in files]

    def namespace(self, values: dict[str, Any]) -> argparse.Namespace:
        """What the command's parser would return for these values: its defaults, then each value through the
        option's own converter (``--resolution 768,768`` -> 768), whose complaint is a ``BadBody``."""
        namespace = argparse.Namespace(**self.defaults, command=self.command)
        for key, value in values.items():
            action = self.actions[key]
            try:
                if isinstance(value, list):
                    value = [convert(action, item) for item in value]
                else:
                    value = convert(action, value)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
                raise BadBody(f"{key}: {error}") from None
            setattr(namespace, action.dest, value)
        return namespace


class BadBody(ValueError):
    """A request body its schema refuses: one line, a 400."""


def convert(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool) or action.type is None or action.choices is not None:
        return value
    return action.type(str(value)) if callable(action.type) else value


def describe(error: ValidationError, schema: CommandSchema) -> str:
    """pydantic's first complaint as one line: the key, what is wrong, the keys this endpoint takes."""
    first = error.errors(include_url=False)[0]
    loc = first.get("loc", ())  # (key,), (key, index), then pydantic's union member tags, which are left out
    where = "".join([str(loc[0])[:40], *(f"[{part}]" for part in loc[1:2] if isinstance(part, int))]) if loc else "body"
    where = repr(where) if any(ord(c) < 32 for c in where) else where
    if first.get("type") == "extra_forbidden":
        known = ", ".join(sorted(schema.model.model_fields))
        return f"{where}: not an option of autotune {schema.command} (this endpoint takes {known})"
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{where}: {message}; see autotune {schema.command} --help for the options"


def command_schema(command: str, extra: dict[str, Any] | None = None) -> CommandSchema:
    """The schema of ``autotune COMMAND``'s options, less the ones a page never sets, plus ``extra`` fields
    (``{key: (type, default)}``: the endpoint's own keys, such as a run's name, which are no option)."""
    from autotune.cli import build_parser

    parser = build_parser(command)
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr,index]
    actions: dict[str, argparse.Action] = {}
    fields: dict[str, Any] = {}
    for action in sub._actions:
        key = body_key(action)
        if key in NOT_FROM_THE_PAGE or action.dest in NOT_FROM_THE_PAGE:
            continue
        actions[key] = action
        required = action.required or not action.option_strings
        fields[key] = (_field_type(action), ... if required else None)
    defaults = {a.dest: a.default for a in sub._actions if a.default is not argparse.SUPPRESS}
    defaults.update(sub._defaults)
    titles = {id(action): group.title or "" for group in sub._action_groups for action in group._group_actions}
    groups = {key: RUN_GROUP if titles.get(id(action)) in ("options", "positional arguments") else titles[id(action)]
              for key, action in actions.items()}
    model = create_model(f"{command.title()}Body", __config__=ConfigDict(extra="forbid"), **fields, **(extra or {}))
    return CommandSchema(command, model, actions, defaults, groups)


def form_fields(schema: CommandSchema, plan: CommandSchema) -> list[dict[str, Any]]:
    """The page's form, made from the schema it is validated with: per body key its group, kind (flag, choice,
    integer, number, text, path, list), choices, default, help, the plan's key it sets (``config``: the
    sd-scripts spelling among its names, whose planned value and reason the page shows beside it) and whether
    ``plan`` takes it too (a run's own options, such as its retries, are sent with Start only)."""
    paths = set(schema.path_keys())
    out = []
    for key, action in schema.actions.items():
        kind = ("flag" if isinstance(action, argparse._StoreTrueAction) else "path" if key in paths
                else "list" if isinstance(action, argparse._AppendAction) else "choice" if action.choices
                else "integer" if action.type is int else {"integer": "integer", "finite number": "number"}.get(
                    getattr(action.type, "__name__", ""), "text"))
        longs = [o[2:] for o in action.option_strings if o.startswith("--")]
        config = next((name for name in longs if "_" in name), key)
        default = action.default if isinstance(action.default, str | int | float | bool) else None
        out.append({"key": key, "group": schema.groups[key], "kind": kind, "help": action.help or "",
                    "choices": list(action.choices) if action.choices else None, "default": default,
                    "config": config, "plan": key in plan.actions, "required": action.required})
    return out


class PresetImport(BaseModel):
    """POST /api/presets/import: a preset file's text and what wrote it (a kohya_ss GUI preset, a sd-scripts
    config.toml)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["kohya_ss", "sd-scripts"]
    text: Annotated[StrictStr, Field(max_length=512 * 1024)]


def request_of(model: type[ModelT], body: Any, send: str) -> ModelT:
    """``body`` as ``model`` (a request of its own shape, not a command's options), or ``BadBody`` with the first
    wrong key and what to ``send``."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        raise BadBody(f"{'.'.join(str(p) for p in first.get('loc', ())) or 'body'}: {first['msg']}; send "
                      f"{send}") from None


def given(model: BaseModel) -> dict[str, Any]:
    """The values a body set (what it left out keeps the command's default)."""
    return {key: getattr(model, key) for key in model.model_fields_set}
