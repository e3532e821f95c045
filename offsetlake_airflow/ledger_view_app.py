"""Airflow UI "Offset ledger" view and its JSON API, behind Airflow's own authentication.

A FastAPI app mounted by the API server under ``/offsetlake`` (``fastapi_apps``) and a nav entry
(``external_views`` with ``url_route``) that embeds its pages in the Airflow UI at
``/plugin/offsetlake-ledger``:

  GET /offsetlake/ledger                              pipelines: total lag, last commit, last batch
  GET /offsetlake/ledger/{pipeline}                   lag chart per partition, recent batches, gaps
  GET /offsetlake/ledger/{pipeline}/reports/{batch}   the batch's validation report (HTML)
  GET /offsetlake/api/pipelines                       the pipelines list as JSON
  GET /offsetlake/api/pipelines/{pipeline}?limit=N    one pipeline as JSON (limit=0: every batch)
  GET /offsetlake/metrics                             Prometheus text (lag, last commit, batches, lease)

Plugin endpoints are not protected by the API server, so every route here (but the nav icon)
resolves the caller with Airflow's ``get_user``: a bearer JWT from ``POST /auth/token``, or the
UI's ``_token`` cookie when the page is opened inside the Airflow UI. No credential: 401; an
invalid one: 403. A pipeline is shown only to users who may read the runs of its
``<pipeline>_ingest`` DAG. The data comes from ``offsetlake.ledger_view`` (read-only); this module
only authenticates, adds Airflow links and renders. ``plugins/offsetlake_plugins.py`` registers it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, unquote, urlparse

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from offsetlake.config import PipelineConfig
from offsetlake.errors import message
from offsetlake_airflow import pipelines_folder
from offsetlake_airflow.connections import load_config

URL_PREFIX = "/offsetlake"
UI_ROUTE = "offsetlake-ledger"
ASSETS = Path(__file__).resolve().parent / "ledger_view"

app = FastAPI(title="offsetlake offset ledger", docs_url=None, redoc_url=None, openapi_url=None)


class LoginRequired(Exception):
    """A page was opened without Airflow credentials: answer 401 with a link to the login."""


# ---- authentication and authorization (Airflow's) --------------------------------------------
async def airflow_user(request: Request) -> Any:
    """The caller as Airflow's API resolves it: bearer token first, else the UI's cookie."""
    # Imported here: every Airflow component loads plugins, only the API server serves them.
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user

    return await get_user(request, _oauth_token=None, bearer_credentials=await bearer_scheme(request))


async def page_user(request: Request) -> Any:
    try:
        return await airflow_user(request)
    except HTTPException as err:
        if err.status_code == 401:
            raise LoginRequired from None
        raise


User = Annotated[Any, Depends(airflow_user)]
PageUser = Annotated[Any, Depends(page_user)]


def may_read(user: Any, pipeline: str) -> bool:
    """Whether ``user`` may read the dag runs of the pipeline's ingest DAG."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.configuration import conf

    dag_id = f"{pipeline}_ingest"
    team = None
    if conf.getboolean("core", "multi_team", fallback=False):
        from airflow.models.dag import DagModel

        team = DagModel.get_team_name(dag_id)
    return get_auth_manager().is_authorized_dag(
        method="GET", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id, team_name=team), user=user
    )


def visible_pipelines(user: Any) -> list[str]:
    from offsetlake.config import pipeline_names

    return [name for name in pipeline_names(pipelines_folder()) if may_read(user, name)]


def readable_config(user: Any, pipeline: str) -> PipelineConfig:
    """The pipeline's config (Kafka connection overrides applied); 404 unknown, 403 not allowed."""
    from offsetlake.config import pipeline_names

    if pipeline not in pipeline_names(pipelines_folder()):
        raise HTTPException(404, f"no pipeline '{pipeline}' in {pipelines_folder()}")
    if not may_read(user, pipeline):
        raise HTTPException(403, f"not allowed to read the runs of DAG {pipeline}_ingest")
    return load_config(pipeline)


# ---- data, with the links only Airflow knows --------------------------------------------------
def with_links(request: Request, pipeline: str, detail: dict) -> dict:
    """Add to each batch the Airflow UI address of the dag run that made it (None for CLI
    runs) and the address of its validation report under this plugin."""
    airflow_root = request.scope.get("app_root_path", "")
    for batch in detail["batches"]:
        batch["airflow_run_url"] = (
            f"{airflow_root}/dags/{quote(batch['dag_id'], safe='')}/runs/{quote(batch['run_id'], safe='')}"
            if batch["dag_id"] and batch["run_id"]
            else None
        )
        batch["report_url"] = (
            f"{request.scope.get('root_path', '')}/ledger/{pipeline}/reports/{quote(batch['batch_id'])}"
            if batch["validation_report"]
            else None
        )
    return detail


def overview(user: Any) -> list[dict]:
    from offsetlake.ledger_view import pipelines_overview

    return pipelines_overview(visible_pipelines(user), load_config)


def detail(request: Request, user: Any, pipeline: str, limit: int) -> dict:
    from offsetlake.ledger_view import pipeline_detail

    return with_links(request, pipeline, pipeline_detail(readable_config(user, pipeline), limit))


# ---- JSON API -------------------------------------------------------------------------------
@app.get("/api/pipelines")
def api_pipelines(user: User) -> dict:
    return {"pipelines": overview(user)}


@app.get("/api/pipelines/{pipeline}")
def api_pipeline(
    request: Request, user: User, pipeline: str, limit: Annotated[int, Query(ge=0, description="recent batches to list; 0 = all")] = 25
) -> dict:
    return detail(request, user, pipeline, limit)


# ---- Prometheus -------------------------------------------------------------------------------
@app.get("/metrics")
def metrics(user: User) -> Response:
    """Prometheus text: lag per partition, last commit, last batch, batch counts, stream lease,
    for the pipelines the caller may read (a scrape job sends an Airflow token as bearer)."""
    from offsetlake.metrics import CONTENT_TYPE, prometheus_text

    return Response(prometheus_text(visible_pipelines(user), load_config), media_type=CONTENT_TYPE)


# ---- pages ----------------------------------------------------------------------------------
@cache
def templates():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ASSETS), autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["num"] = lambda n: "" if n is None else f"{n:,}"
    env.filters["ts"] = lambda iso: "" if not iso else iso[:19].replace("T", " ") + " UTC"
    return env


def render(request: Request, template: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    page = templates().get_template(template).render(base=request.scope.get("root_path", ""), **values)
    return HTMLResponse(page, status_code=status_code)


@app.get("/ledger", response_class=HTMLResponse)
def page_pipelines(request: Request, user: PageUser) -> HTMLResponse:
    return render(request, "pipelines.html", pipelines=overview(user))


@app.get("/ledger/{pipeline}", response_class=HTMLResponse)
def page_pipeline(request: Request, user: PageUser, pipeline: str) -> HTMLResponse:
    return render(request, "pipeline.html", p=detail(request, user, pipeline, 25))


@app.get("/ledger/{pipeline}/reports/{batch_id}")
def page_report(user: PageUser, pipeline: str, batch_id: str) -> Response:
    """The HTML validation report the batch's ledger row points to, read from the lake (a local
    folder or object storage) and only from under the pipeline's validation folder."""
    from offsetlake import storage
    from offsetlake.ledger_view import validation_report

    config = readable_config(user, pipeline)
    uri = validation_report(config, batch_id)
    if uri is None:
        raise HTTPException(404, message(f"batch {batch_id} has no validation report", {"pipeline": pipeline, "batch_id": batch_id}))
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = Path(unquote(parsed.path)).resolve()
        if path.is_file() and path.is_relative_to(Path(config.validation_path).resolve()):
            return FileResponse(path, media_type="text/html")
    elif uri.startswith(config.validation_path.rstrip("/") + "/") and ".." not in uri:
        # the pipeline's own storage settings reach its reports
        fs, location = storage.filesystem(storage.Location(uri, config.layout.validation.options))
        try:
            with fs.open_input_stream(location) as report:
                return Response(report.read(), media_type="text/html")
        except OSError:
            pass
    raise HTTPException(
        404, message(f"the report of batch {batch_id} is not readable here: {uri}", {"pipeline": pipeline, "batch_id": batch_id})
    )


@app.get("/static/ledger.svg", include_in_schema=False)
def icon() -> FileResponse:  # the nav icon: no data, so no login needed
    return FileResponse(ASSETS / "ledger.svg", media_type="image/svg+xml")


@app.exception_handler(LoginRequired)
def login_required(request: Request, _: LoginRequired) -> HTMLResponse:
    from airflow.api_fastapi.app import get_auth_manager

    login = get_auth_manager().get_url_login(next_url=request.url.path)
    return render(request, "login.html", status_code=401, login=login)


@app.exception_handler(StarletteHTTPException)
def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse | HTMLResponse:
    if request.url.path.startswith(f"{request.scope.get('root_path', '')}/ledger"):
        return render(request, "error.html", status_code=err.status_code, status=err.status_code, detail=err.detail)
    return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)
