"""A trainer's checkout chosen on the page (POST /api/engines): the user's sd-scripts or musubi-tuner, picked in the
allowed folders, offered to the page's runs beside those ``autotune ui --engine`` named.

A checkout is code the runs will execute, so it is taken only as the command line would take it: inside the folders
this server may use (``AccessPolicy.resolve``), and only when the engine's own ``offer`` check finds that trainer
there (``src/musubi_tuner``, sd-scripts' scripts) and the Python that runs it (the checkout's venv, else this one;
a page never names a Python). The request passes the same guards as every other POST (Host, Origin, JSON, the token
where there is one), so a site the user visits cannot make it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from autotune.ui.errors import BadRequest
from autotune.ui.schemas import BadBody, request_of


class CheckoutChoice(BaseModel):
    """POST /api/engines: which trainer, and the folder it was cloned into."""

    model_config = ConfigDict(extra="forbid")
    kind: Annotated[StrictStr, Field(max_length=64)]
    path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]


def add_checkout(body: Any, policy: Any, offered: dict[str, list[str]]) -> dict[str, Any]:
    """Check the chosen checkout and offer it under its trainer's name (replacing that trainer's earlier one)."""
    from autotune.launch.engines import registered_engines
    from sd_scripts_compat.facts.errors import UserError

    try:
        choice = request_of(CheckoutChoice, body, '{"kind": "musubi-tuner" or "sd-scripts", "path": the folder '
                            'you cloned}')
    except BadBody as error:
        raise BadRequest(str(error)) from None
    kinds = {name: kind for name, kind in registered_engines().items() if kind.offer is not None}
    kind = kinds.get(choice.kind)
    if kind is None or kind.offer is None:
        raise BadRequest(f"kind {choice.kind[:40]!r}: choose one of {', '.join(kinds)}")
    folder = policy.resolve(choice.path, kind.checkout)
    if not folder.is_dir():
        raise BadRequest(f"{kind.checkout} {choice.path}: not a folder; pick the folder you cloned", status=404)
    try:
        options = kind.offer(folder, None)
    except UserError as error:  # the command line's own refusal, without its option name
        raise BadRequest(str(error).replace(f"--engine {kind.name}=", "", 1)) from None
    offered[kind.name] = options
    return {"engines": list(offered), "name": kind.name, "options": options}
