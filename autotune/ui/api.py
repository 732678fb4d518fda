"""The web app's HTTP API: the CLI's commands behind JSON, with the field names their ``--json`` outputs use.

A request body is the command's own options by their long names (``{"dataset": "...", "model": "builtin:tiny-sd15",
"vram": 12, "rank": 16}`` is ``autotune plan DATASET --model builtin:tiny-sd15 --vram 12 --rank 16``), validated by
a schema made from the command's own options (schemas.py) and run through the function the CLI runs, so the API and
the CLI cannot drift apart and no body is ever read as a command line. Every refusal is one JSON line
``{"error": "..."}`` with a 4xx status: 400 bad input, 401 no token, 403 refused (origin, a path outside the allowed
folders), 404 unknown, 405 not a POST, 409 a run in the wrong state, 413 a body too large, 415 not JSON, 421 not
this server's name, 422 a plan that does not fit; nothing is written by a refused request.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request  # at module level: FastAPI reads the handlers' annotations by name

from autotune.ui.errors import BadRequest
from autotune.ui.schemas import BadBody, CommandSchema, given
from autotune.ui.security import TOKEN_COOKIE, AccessPolicy, Refused

if TYPE_CHECKING:
    from starlette.middleware.base import RequestResponseEndpoint
    from starlette.responses import Response

    from autotune.launch.presets import Imported
    from autotune.planning.planner import Plan
    from autotune.report.load import RunFiles
    from autotune.ui.runs import EngineChoice, RunStore

MAX_BODY_BYTES = 1 << 20  # a request body (the largest real one, a run with every option, is under 4 KiB)
TOO_LARGE = f"the request body is over {MAX_BODY_BYTES // 1024} KiB; send the options only"
JSON_TYPE = "application/json"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Resource-Policy": "same-origin",
}

# a run's files as the pages may fetch them: images, LoRAs, and text as text (never HTML, SVG or script, which a
# file dropped into a run folder could otherwise run with the page's origin)
RUN_FILE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
                  ".safetensors": "application/octet-stream", ".toml": "text/plain; charset=utf-8",
                  ".json": "text/plain; charset=utf-8", ".jsonl": "text/plain; charset=utf-8",
                  ".log": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; sandbox"  # the report: no script runs

T = TypeVar("T")


def checked_values(schema: CommandSchema, body: Any, policy: AccessPolicy) -> dict[str, Any]:
    """The body's values, validated by ``schema``, with every path resolved inside the allowed folders."""
    try:
        values = given(schema.validate(body))
    except BadBody as error:
        raise BadRequest(str(error)) from None
    for key in schema.path_keys():
        if key in values and not (key == "model" and is_builtin(values[key])):
            values[key] = str(policy.resolve(values[key], key))
    return values


def is_builtin(model: str) -> bool:
    """``builtin:NAME`` of a family the engine builds (anything else is a path, checked like any other)."""
    from sd_scripts_compat.facts.families import family_names
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX

    return model.startswith(BUILTIN_PREFIX) and model.removeprefix(BUILTIN_PREFIX) in family_names()


def command_args(schema: CommandSchema, values: dict[str, Any]) -> argparse.Namespace:
    try:
        return schema.namespace(values)
    except BadBody as error:
        raise BadRequest(str(error)) from None


def create_app(policy: AccessPolicy, runs_dir: Path, engines: dict[str, list[str]] | None = None) -> FastAPI:
    """The app; ``engines``: the engine names a page may choose, each with the ``autotune run`` options it adds
    (``autotune ui --engine``); autotune's own alone by default."""
    from autotune import __version__

    offered = engines or {"autotune": []}
    app = FastAPI(title="lora-autotune", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)

    add_guards(app, policy)

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__, "runs_dir": str(runs_dir),
                "allowed_roots": [str(root) for root in policy.allowed_roots], "engines": list(offered)}

    @app.get("/api/probe")
    def probe() -> dict[str, Any]:
        from autotune.hardware.probe import probe_system

        return json.loads(probe_system(output_dir=str(runs_dir)).to_json())

    @app.get("/api/browse")
    def browse(path: str | None = None) -> dict[str, Any]:
        return browse_folder(policy, path)

    @app.post("/api/engines")
    async def add_engine(request: Request) -> dict[str, Any]:
        """A trainer's checkout picked on the page, offered to its runs (``ui.checkouts``)."""
        from autotune.ui.checkouts import add_checkout

        return await _in_thread(add_checkout, await json_body(request), policy, offered)

    warmed = threading.Event()

    schemas = Schemas()

    @app.get("/api/options")
    def options() -> dict[str, Any]:
        """The new-training form: ``autotune run``'s options as the run endpoint validates them, in their groups."""
        from autotune.ui.schemas import form_fields

        return {"fields": form_fields(schemas.run(tuple(offered)), schemas.get("plan"))}

    @app.post("/api/presets/import")
    async def import_preset(request: Request) -> dict[str, Any]:
        """A kohya_ss GUI preset or a sd-scripts config.toml as the plan's options, every key of it accounted for
        (``launch.presets``); nothing is written."""
        return await _in_thread(imported_preset, await json_body(request), schemas.get("plan"))

    @app.post("/api/doctor")
    async def doctor(request: Request) -> dict[str, Any]:
        schema = schemas.get("doctor")
        args = command_args(schema, checked_values(schema, await json_body(request), policy))
        await _in_thread(warmed.wait)
        return await _in_thread(run_doctor, args)

    @app.post("/api/plan")
    async def plan(request: Request) -> Any:
        schema = schemas.get("plan")
        args = command_args(schema, checked_values(schema, await json_body(request), policy))
        planned = await _in_thread(run_plan, args)
        beside = await _in_thread(files_beside, planned)
        return {**planned, "start": start_verdicts(planned, list(offered)), "beside": beside,
                "engine_needed": engine_needed(planned, offered)}

    @app.get("/api/thumbnail")
    async def thumbnail(dataset: str, file: str, model: str | None = None, resolution: int | None = None) -> Any:
        from fastapi.responses import Response

        image = dataset_file(policy, dataset, file)
        if model and not is_builtin(model):
            model = str(policy.resolve(model, "model"))
        png, crop = await _in_thread(crop_or_refuse, image, model, resolution)
        return Response(png, media_type="image/png", headers={"X-Autotune-Crop": json.dumps(crop),
                                                              "Cache-Control": "no-cache"})

    add_run_routes(app, policy, runs_dir, offered, schemas)
    add_pages(app)
    threading.Thread(target=warm_up, args=(warmed,), name="warm-up", daemon=True).start()
    return app


def add_guards(app: FastAPI, policy: AccessPolicy) -> None:
    """The access policy and request rules before routing (``check_request``), the security headers on every
    answer, and every refusal as one JSON line."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def guard(request: Request, call_next: RequestResponseEndpoint) -> Response:
        try:
            check_request(policy, request)
            response = await call_next(request)
        except Refused as refused:
            response = JSONResponse({"error": str(refused)}, status_code=refused.status)
        else:
            if policy.token and request.query_params.get("token"):  # the page's own script, style and images
                response.set_cookie(TOKEN_COOKIE, policy.token, httponly=True, samesite="strict")  # carry it
        for key, value in SECURITY_HEADERS.items():  # a page of its own (the report) keeps its own policy
            response.headers.setdefault(key, value)
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, error: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status)

    @app.exception_handler(Refused)
    async def refused(_: Request, error: Refused) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def bad_query(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]  # FastAPI's own check of a query parameter: its one line in our form
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "request"
        return JSONResponse({"error": f"{where}: {first.get('msg', 'invalid')}"}, status_code=400)


def warm_up(done: threading.Event) -> None:
    """Import what the first doctor request needs (transformers and the shipped CLIP tokenizer, ~1.5 s) while the
    user picks a dataset, so the new-training page answers in well under a second. The doctor waits for ``done``:
    transformers' lazy imports are not safe to race from two threads."""
    from autotune.doctor.captions import shipped_token_counter

    try:
        shipped_token_counter()
    except Exception:  # noqa: BLE001, S110 (a warm-up only: the request itself says what is wrong)
        pass
    finally:
        done.set()


STATIC = Path(__file__).resolve().parent / "static"


def add_pages(app: FastAPI) -> None:
    """The pages: one HTML file and its script and style, shipped in the package (nothing from a CDN)."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")


def add_run_routes(app: FastAPI, policy: AccessPolicy, runs_dir: Path, engines: dict[str, list[str]],
                   schemas: Schemas) -> None:
    """Runs: list, start or queue, one run, its live events, stop, resume, its report."""
    from fastapi.responses import StreamingResponse

    from autotune.ui.runs import RunStore

    store = RunStore(runs_dir, policy)
    threading.Thread(target=serve_queue, args=(store,), name="run-queue", daemon=True).start()
    add_run_file_routes(app, store)

    @app.get("/api/runs")
    def runs() -> dict[str, Any]:
        return {"runs": [store.info(run_id) for run_id in store.ids()], "queue": store.queue()}

    @app.post("/api/runs", status_code=201)
    async def start(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        if isinstance(body, dict) and isinstance(body.get("engine"), str) and body["engine"] not in engines:
            raise BadRequest(f"engine {body['engine'][:40]!r}: this server offers {', '.join(engines)} (autotune ui "
                             "--engine sd-scripts=PATH or musubi-tuner=PATH, or POST /api/engines, adds yours)")
        schema = schemas.run(tuple(engines))
        values = checked_values(schema, body, policy)
        engine, name = values.pop("engine", "autotune"), values.pop("name", None)
        args = command_args(schema, values)  # refused here, as the CLI refuses it, before any folder
        choice = engine_choice(engine, engines[engine])
        if choice is not None:  # the user's trainer refuses what it cannot load (a built-in model) before any folder
            await _in_thread(check_engine, choice, args)
        return await _in_thread(store.start, values, choice, args.dataset, args.model, name)

    @app.get("/api/runs/{run_id}")
    def one(run_id: str) -> dict[str, Any]:
        return store.info(run_id)

    @app.post("/api/runs/{run_id}/stop")
    def stop(run_id: str) -> dict[str, Any]:
        return store.stop(run_id)

    @app.post("/api/runs/{run_id}/resume")
    def resume(run_id: str) -> dict[str, Any]:
        return store.resume(run_id)

    @app.get("/api/runs/{run_id}/report")
    def report(run_id: str) -> Any:
        from autotune.report.render import render_json

        return json.loads(render_json(run_report(store.folder(run_id))[0]))

    @app.get("/api/runs/{run_id}/lora")
    def lora(run_id: str) -> dict[str, Any]:
        """``autotune inspect RUN --json`` of the run's LoRA, with ``download``: its path under /files/."""
        return inspect_run(store.folder(run_id), run_id, policy)

    @app.get("/api/runs/{run_id}/events")
    def events(run_id: str) -> StreamingResponse:
        from autotune.ui.events import run_events

        store.folder(run_id)
        return StreamingResponse(run_events(store, run_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def add_run_file_routes(app: FastAPI, store: RunStore) -> None:
    """What a run wrote, for its page: the report page and its files (samples, LoRA, configs, logs)."""

    @app.get("/api/runs/{run_id}/report.html")
    def report_page(run_id: str) -> Any:
        """``autotune report``'s page of the run, drawn now (inline style and SVG, no script: served sandboxed)."""
        from fastapi.responses import HTMLResponse

        from autotune.report.html import render_html

        return HTMLResponse(render_html(*run_report(store.folder(run_id))),
                            headers={"Content-Security-Policy": REPORT_CSP})

    @app.get("/api/runs/{run_id}/files/{name:path}")
    def run_file(run_id: str, name: str) -> Any:
        """A file of the run (its samples, its LoRA, its configs and logs as plain text), never one outside its
        folder, and never as a page or a script (``RUN_FILE_TYPES``)."""
        from fastapi.responses import FileResponse

        folder = store.folder(run_id)
        path = (folder / name).resolve()
        if folder not in path.parents or not path.is_file():
            raise BadRequest(f"run {run_id}: no file {name} in it", status=404)
        media = RUN_FILE_TYPES.get(path.suffix.lower())
        if media is None:
            raise BadRequest(f"run {run_id}: {name} is not served (only {', '.join(RUN_FILE_TYPES)} files)",
                             status=404)
        return FileResponse(path, media_type=media)


def run_report(folder: Path) -> tuple[dict[str, Any], RunFiles]:
    """``autotune report``'s findings for the run and the files they came from; a run with nothing to report yet
    is a 404 with the report's own line."""
    from autotune.report.analysis import build_report
    from autotune.report.load import load_run
    from sd_scripts_compat.facts.errors import UserError, one_line

    try:
        files = load_run(folder)
    except UserError as error:
        raise BadRequest(one_line(error), status=404) from None
    return build_report(files), files


def serve_queue(store: RunStore) -> None:
    """Start the next queued run whenever none trains (a restarted server keeps serving the queue it finds)."""
    while True:
        try:
            store.tick()
        except OSError:
            pass
        time.sleep(1.0)


def engine_choice(name: str, options: list[str]) -> EngineChoice | None:
    """The offered engine's record (its ``--engine`` / ``--python`` as ``autotune ui`` was started); None: ours."""
    from autotune.ui.runs import EngineChoice

    if not options:
        return None
    values = dict(zip(options[::2], options[1::2], strict=True))
    return EngineChoice(name=name, engine=values["--engine"], python=values.get("--python"))


def check_engine(choice: EngineChoice, args: argparse.Namespace) -> None:
    """The user's engine (an ``EngineChoice``) refuses what it cannot train (a built-in model, another trainer's
    family) before any folder is made, as ``autotune run`` does (``launch.engines.check_engine``)."""
    from argparse import Namespace

    from autotune.launch.engines import check_engine as check_chosen
    from sd_scripts_compat.models.detect import detect_family

    chosen = Namespace(**{**vars(args), "engine": choice.engine, "python": choice.python})
    check_chosen(chosen, detect_family(args.model, getattr(args, "family", None)) if args.model else None)


def inspect_run(folder: Path, run_id: str, policy: AccessPolicy) -> dict[str, Any]:
    """The run's LoRA as ``autotune inspect`` shows it, with its download path; a LoRA the run wrote outside its
    folder (its config's ``output_dir``) is shown when it lies in the allowed folders, without a download."""
    from autotune.report.load import run_lora
    from sd_scripts_compat.facts.errors import UserError, one_line
    from sd_scripts_compat.network.lora_file import describe_lora_file

    path = run_lora(folder)
    if path == folder:
        raise BadRequest(f"run {run_id}: no LoRA written yet", status=404)
    inside = folder in path.resolve().parents
    if not inside:
        try:
            policy.resolve(str(path), "LoRA")
        except Refused:
            raise BadRequest(f"run {run_id}: its LoRA {path} lies outside the folders this server may use",
                             status=404) from None
    try:
        info = describe_lora_file(path)
    except UserError as error:
        raise BadRequest(one_line(error), status=409) from None
    download = f"/api/runs/{run_id}/files/{path.resolve().relative_to(folder).as_posix()}" if inside else None
    return {**info, "download": download}


def check_request(policy: AccessPolicy, request: Request) -> None:
    """The access policy (security.py) before routing, then what a state change must be: a POST of JSON."""
    headers = request.headers
    policy.check_host(headers.get("host"))
    policy.check_token(headers.get("authorization"), request.query_params.get("token"),
                       request.cookies.get(TOKEN_COOKIE))
    if request.method in ("GET", "HEAD"):
        return
    if request.method != "POST":
        raise Refused(405, f"{request.method} is not used here; state changes are POSTs")
    policy.check_origin(headers.get("origin"), headers.get("sec-fetch-site"), headers.get("authorization"),
                        headers.get("host"))
    if headers.get("content-type", "").partition(";")[0].strip().lower() != JSON_TYPE:
        raise Refused(415, f"send the body as {JSON_TYPE} (Content-Type: {JSON_TYPE})")
    length = headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise Refused(413, TOO_LARGE)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def json_body(request: Request) -> Any:
    """The request's JSON value (its schema checks the shape), read up to ``MAX_BODY_BYTES``; else 400 / 413."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(TOO_LARGE, 413)
    try:
        return json.loads(bytes(raw) or b"{}", parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply; send one flat JSON object of options") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not JSON ({str(error)[:120]}); send one JSON object") from None


class Schemas:
    """The commands' body schemas, built on first use (each imports its command's options)."""

    def __init__(self) -> None:
        self.built: dict[Any, CommandSchema] = {}

    def get(self, command: str) -> CommandSchema:
        from autotune.ui.schemas import command_schema

        if command not in self.built:
            self.built[command] = command_schema(command)
        return self.built[command]

    def run(self, engines: tuple[str, ...]) -> CommandSchema:
        """``autotune run``'s options plus the run's own keys: the engine (one of those offered) and a name."""
        from typing import Literal

        from autotune.ui.schemas import RunName, command_schema

        key = ("run", engines)
        if key not in self.built:
            self.built[key] = command_schema("run", {"engine": (Literal[engines], "autotune"),
                                                     "name": (RunName | None, None)})
        return self.built[key]


async def _in_thread(function: Callable[..., T], *args: object) -> T:
    """A command's work (plans, dataset scans) off the event loop; its UserError becomes a 400."""
    from starlette.concurrency import run_in_threadpool

    from sd_scripts_compat.facts.errors import UserError, one_line

    try:
        return await run_in_threadpool(function, *args)
    except UserError as error:
        raise BadRequest(one_line(error)) from None


def run_doctor(args: argparse.Namespace) -> dict[str, Any]:
    """``autotune doctor DATASET --json`` as a dict (format lora-autotune-doctor/1)."""
    from autotune.doctor.diagnose import diagnose_options
    from autotune.doctor.render_json import to_json

    return json.loads(to_json(diagnose_options(args)))


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    """``autotune plan ... --json`` as a dict; a plan that cannot fit is 422 with its reason."""
    from autotune.launch.plan_options import accept_pickle, build_request
    from autotune.planning.planner import plan_training

    if getattr(args, "out", None):
        raise BadRequest("out: the API plans without writing; start a run to write its configs")
    accept_pickle(args, "plan")
    plan = plan_training(build_request(args))
    if not plan.fits:
        raise BadRequest(plan.message, status=422)
    return {**plan.to_dict(), "configs": plan_configs(plan, args.format)}


def imported_preset(body: Any, schema: CommandSchema) -> dict[str, Any]:
    """The preset's options (``launch.presets``), each checked as the plan checks it: a value the plan would refuse
    moves to ``ignored`` with the plan's own line."""
    import tomllib

    from autotune.launch.presets import from_kohya_gui, from_sd_scripts
    from autotune.ui.schemas import BadBody, PresetImport, request_of

    try:
        request = request_of(PresetImport, body, '{"format": "kohya_ss" or "sd-scripts", "text": the file\'s text}')
    except BadBody as error:
        raise BadRequest(str(error)) from None
    try:
        data = json.loads(request.text) if request.format == "kohya_ss" else tomllib.loads(request.text)
    except (ValueError, RecursionError) as error:
        kind = "JSON" if request.format == "kohya_ss" else "TOML"
        raise BadRequest(f"text: not a {request.format} preset ({kind}: {str(error)[:120]})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"text: not a {request.format} preset (one object of settings)")
    imported = from_kohya_gui(data) if request.format == "kohya_ss" else from_sd_scripts(data)
    _refuse_what_the_plan_refuses(imported, schema)
    return imported.as_dict()


def _refuse_what_the_plan_refuses(imported: Imported, schema: CommandSchema) -> None:
    """Each value of ``imported`` the plan's schema or converter refuses leaves ``values`` for ``ignored``, with
    the plan's own line (the rest still plans)."""
    for _ in range(len(imported.values)):
        try:
            body = {**imported.values, "dataset": ".", "model": "builtin:tiny-sd15"}
            command_args(schema, given(schema.validate(body)))
            return
        except BadBody as error:
            line = str(error)
        except BadRequest as error:
            line = str(error)
        key = line.split(":", 1)[0].split("[", 1)[0]
        if key not in imported.values:
            raise BadRequest(line)
        imported.values.pop(key)
        for source, option in list(imported.applied.items()):
            if option == key:
                del imported.applied[source]
                imported.ignored[source] = line


def start_verdicts(planned: dict[str, Any], offered: list[str]) -> dict[str, str | None]:
    """Per offered engine, why a run of this plan cannot start (None: it can), before any click: the files the
    family needs and no one gave, or an engine that does not train the family (``EngineKind.trains``)."""
    from autotune.launch.engines import check_engine_trains, registered_engines
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.facts.families import get_family

    family = get_family(planned["family"])
    missing = [c["key"] for c in planned["choices"] if c.get("placeholder")]
    wrong = wrong_files(planned)
    kinds = registered_engines()
    verdicts: dict[str, str | None] = {}
    for name in offered:
        try:  # the refusal autotune run gives, word for word
            if name in kinds:
                check_engine_trains(kinds[name], family, str(planned["model"]))
        except UserError as error:
            verdicts[name] = str(error)
            continue
        verdicts[name] = (f"fill in {', '.join(missing)}: the files {family.name} needs" if missing
                          else wrong or None)
    return verdicts


def engine_needed(planned: dict[str, Any], offered: dict[str, list[str]]) -> dict[str, str] | None:
    """The trainer this plan's family needs when the page offers none (its name and what its checkout is, for the
    page's picker); None when an offered engine trains it."""
    from autotune.launch.engines import engine_for
    from sd_scripts_compat.facts.families import get_family

    kind = engine_for(get_family(planned["family"]))
    if kind.name in offered or kind.offer is None:
        return None
    return {"name": kind.name, "checkout": kind.checkout}


def wrong_files(planned: dict[str, Any]) -> str:
    """The first of the model's given files that holds another part than its field names (by its header:
    ``models.part_kind``), or is no safetensors file; '' when none (a kind we do not tell apart passes)."""
    from sd_scripts_compat.models.checkpoint import read_checkpoint
    from sd_scripts_compat.models.part_kind import KIND_NAMES, OPTION_KINDS, part_kind, takes

    for choice in planned["choices"]:
        key, path = choice["key"], str(choice["value"])
        if not choice.get("model_file") or choice.get("placeholder") or key not in OPTION_KINDS \
                or not path.endswith(".safetensors"):
            continue
        try:
            kind = part_kind(read_checkpoint(path, header_only=True).shapes)
        except Exception:  # noqa: BLE001 (any reason it cannot be read: the run would stop on it too)
            return f"{key}: {path} is not a safetensors file we can read; give the {key} file"
        if not takes(key, kind):
            return f"{key}: {path} holds {KIND_NAMES.get(str(kind), kind)}, not {key}; give the {key} file"
    return ""


def files_beside(planned: dict[str, Any]) -> dict[str, str]:
    """The model's files no one gave that sit beside the model file, told apart by their headers
    (``models.part_kind``), for the page to fill in."""
    from sd_scripts_compat.models.part_kind import parts_beside

    missing = [c["key"] for c in planned["choices"] if c.get("placeholder")]
    model = Path(str(planned["model"]))
    if not missing or is_builtin(str(planned["model"])) or not model.is_file():
        return {}
    return {key: str(path) for key, path in parts_beside(model, missing).items()}


KOHYA_SS_PRESET = "kohya_ss_gui.json"  # the plan as a kohya_ss GUI preset, beside the configs on the page


def plan_configs(plan: Plan, fmt: str) -> dict[str, str]:
    """The files ``autotune plan --out`` would write, as text (the page shows them and offers them as downloads):
    sd-scripts' configs and the plan as a kohya_ss GUI preset, or musubi-tuner's three files for a family it
    trains."""
    from autotune.launch.presets import to_kohya_gui
    from autotune.planning.musubi_writer import is_musubi_plan
    from autotune.planning.toml_writer import render_plan_files

    files = render_plan_files(plan, fmt)
    if is_musubi_plan(plan):
        return files
    config = {c.key: c.value for c in plan.choices if c.kohya}
    family = plan.family
    checks = {"sdxl": family.is_sdxl, "sd3_checkbox": family.network_module.endswith("_sd3"),
              "flux1_checkbox": family.network_module.endswith("_flux")}
    return {**files, KOHYA_SS_PRESET: json.dumps(to_kohya_gui(config, checks), indent=2, default=str)}


def dataset_file(policy: AccessPolicy, dataset: str, name: str) -> Path:
    """A file inside the dataset folder (which must be inside the allowed roots), else 403 / 404."""
    folder = policy.resolve(dataset, "dataset")
    path = (folder / name).resolve()
    if folder not in path.parents:
        raise Refused(403, f"file {name}: not inside the dataset folder {dataset}")
    if not path.is_file():
        raise BadRequest(f"file {name}: not in {dataset}", status=404)
    return path


def crop_or_refuse(image: Path, model: str | None, resolution: int | None) -> tuple[bytes, dict[str, Any]]:
    from autotune.ui.thumbnails import cropped_thumbnail

    try:
        return cropped_thumbnail(image, model, resolution)
    except ValueError as error:  # smaller than one bucket step: the doctor's "too-small" problem
        raise BadRequest(f"{image.name}: fits no bucket ({error})", status=422) from None


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link to nowhere: not a folder
        return False


def browse_folder(policy: AccessPolicy, path: str | None) -> dict[str, Any]:
    """One folder's subfolders and model files (the new-training page's picker), inside the allowed roots."""
    if path is None:
        return {"path": None, "folders": [str(root) for root in policy.allowed_roots], "files": []}
    folder = policy.resolve(path, "folder")
    if not folder.is_dir():
        raise BadRequest(f"folder {path}: not a folder", status=404)
    folders, files = [], []
    try:  # one listing whose entries know their kind: a folder of 100,000 images costs no stat per image
        with os.scandir(folder) as listing:
            entries = sorted(listing, key=lambda entry: entry.name.lower())
    except OSError as error:
        raise BadRequest(f"folder {path}: cannot list it ({error.strerror})", status=403) from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if _is_dir(entry):
            folders.append(entry.name)
        elif os.path.splitext(entry.name)[1].lower() in (".safetensors", ".ckpt", ".pt", ".pth"):
            files.append(entry.name)
    parent = folder.parent
    allowed_parent = any(parent == root or root in parent.parents for root in policy.allowed_roots)
    return {"path": str(folder), "parent": str(parent) if allowed_parent else None, "folders": folders,
            "files": files}
