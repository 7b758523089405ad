"""The pages as bytes: an HTML template of static/ with its CSS and scripts inlined and a
small configuration object (`window.DUET`) written in. Built once per app.

Every asset is a file inside the package (package data in pyproject.toml), read with
importlib.resources, so an installed package serves the same pages. The response's
Content-Security-Policy allows nothing from another origin: a page that tried to load a
CDN script or a web font would fail loudly in a browser (and in the browser tests).
"""
from __future__ import annotations

import json
from importlib import resources

from fastapi.responses import Response

# page -> (template, stylesheets, scripts), inlined in this order.
PAGES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "chat": ("chat.html", ("common.css", "chat.css"), ("common.js", "chat.js")),
    "dashboard": ("dashboard.html", ("common.css", "dashboard.css"),
                  ("common.js", "charts.js", "summary.js", "dashboard.js")),
}
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'")


def asset(name: str) -> str:
    """The text of static/<name> (UTF-8). FileNotFoundError when the package lacks it."""
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def render(page: str, config: dict) -> bytes:
    """The page's HTML with its assets inlined and `config` as window.DUET."""
    template, styles, scripts = PAGES[page]
    html = asset(template)
    css = "\n".join(asset(s) for s in styles)
    # NOTE: "</" would end the <script> element early; JSON allows the escape "<\/".
    cfg = json.dumps(config).replace("</", "<\\/")
    js = f"window.DUET = {cfg};\n" + "\n".join(asset(s) for s in scripts)
    for marker, text in (("/*STYLE*/", css), ("/*SCRIPT*/", js)):
        if marker not in html:
            raise ValueError(f"static/{template} has no {marker} marker")
        html = html.replace(marker, text, 1)
    return html.encode("utf-8")


def page_response(body: bytes) -> Response:
    """An HTML response of a rendered page (no caching: a restarted server may differ)."""
    return Response(body, media_type="text/html; charset=utf-8",
                    headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store",
                             "X-Content-Type-Options": "nosniff"})
