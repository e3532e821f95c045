"""Registers offsetlake's Airflow plugin: the "Offset ledger" view and its JSON API.

Registrations only; the app is ``offsetlake_airflow.ledger_view_app`` (an installed package).
"""

from airflow.plugins_manager import AirflowPlugin

from offsetlake_airflow.ledger_view_app import UI_ROUTE, URL_PREFIX, app


class OffsetlakeLedgerViewPlugin(AirflowPlugin):
    name = "offsetlake_ledger_view"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "offsetlake offset ledger"}]
    external_views = [
        {
            "name": "Offset ledger",
            "href": f"{URL_PREFIX}/ledger",
            "url_route": UI_ROUTE,
            "destination": "nav",
            "icon": f"{URL_PREFIX}/static/ledger.svg",
        }
    ]
