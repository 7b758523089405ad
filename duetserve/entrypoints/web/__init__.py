"""The pages `duet serve`, `duet router` and `duet cluster` serve to a browser.

    /, /ui        a chat playground over the server's own OpenAI endpoints
    /dashboard    live charts of the engine's steps (polling /dashboard/data)

    pages.py          the HTML of each page: static/ files inlined at start-up (no build
                      step, no CDN: the server may have no internet)
    server_routes.py  `install(app, engine, name)`: the pages, /ui/info and
                      /dashboard/data on an OpenAI server (one call in build_app)
    router_routes.py  `install(app, pool, client)`: the same pages on the router, a
                      summary of every instance and each instance's data proxied

The pages themselves hold no data, so they are open without an API key (PAGE_PATHS);
what they fetch (/v1/..., /dashboard/data) asks for the key like every other route.
"""
from __future__ import annotations

PAGE_PATHS = frozenset({"/", "/ui", "/dashboard"})


def page_url(host: str, port: int, path: str = "/") -> str:
    """The address to open in a browser for a server bound to host:port (a wildcard bind
    is reachable on loopback; an IPv6 literal gets its brackets)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"
