"""`trainguard dashboards render|push`: write the Grafana dashboards, or upload them through grafana-client.

    trainguard dashboards render --out DIR [--policy FILE]
    trainguard dashboards push --url URL --token-file FILE [--folder NAME] [--policy FILE]

`push` creates the folder when missing and overwrites dashboards by their stable uid, so pushing again
updates them in place. The token is read from a file (a service-account token), never from the command
line, where other users could read it in the process list.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

from trainguard import policy as policy_mod

DEFAULT_FOLDER = "trainguard"


class PushError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dashboards_command", metavar="render|push", required=True)
    render = sub.add_parser("render", help="write the dashboards' JSON files")
    # Required, as `alerts render --out`: never into the installed package. The repository's own: --out dashboards.
    render.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    render.add_argument("--policy", metavar="FILE", help="policy YAML whose thresholds the panels show")
    render.add_argument("--mixin", metavar="FILE", help="mixin YAML: the default data source (alerts/mixin.py)")
    push = sub.add_parser("push", help="upload the dashboards to Grafana (overwriting by uid)")
    push.add_argument("--url", required=True, help="Grafana's base URL, e.g. https://grafana.example.com")
    push.add_argument("--token-file", required=True, metavar="FILE",
                      help="file holding a Grafana service-account token (Editor on the folder)")
    push.add_argument("--folder", default=DEFAULT_FOLDER, metavar="NAME",
                      help="folder to put them in, created if missing (default: %(default)s)")
    push.add_argument("--policy", metavar="FILE", help="policy YAML whose thresholds the panels show")
    push.add_argument("--mixin", metavar="FILE", help="mixin YAML: the default data source (alerts/mixin.py)")
    push.add_argument("--timeout", type=float, default=15.0, help="seconds per request (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from trainguard.alerts import mixin as mixin_mod
    from trainguard.dashboards import build

    try:
        policy = policy_mod.load(args.policy)
        mixin = mixin_mod.load(args.mixin)
        if args.dashboards_command == "render":
            for path in build.write(args.out, policy, mixin):
                print(path)
            return 0
        for line in push(args.url, read_token(args.token_file), args.folder, policy, args.timeout, mixin):
            print(line)
        return 0
    except (policy_mod.PolicyError, mixin_mod.MixinError, PushError) as exc:
        print(f"trainguard dashboards {args.dashboards_command}: {exc}", file=sys.stderr)
        return 2


def read_token(path: str | os.PathLike) -> str:
    """The token in `path`; refuses a missing or empty file, and one that other users may read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        token = file.read_text().strip()
    except OSError as exc:
        raise PushError(f"{file}: cannot read the token file ({exc.strerror})") from None
    if mode & 0o077:
        raise PushError(f"{file}: the token file is open to other users (mode {stat.S_IMODE(mode):04o}); "
                        f"run: chmod 600 {file}")
    if not token:
        raise PushError(f"{file}: the token file is empty")
    return token


def folder_uid(title: str) -> str:
    """A stable folder uid from its title, so every push finds the same folder."""
    return re.sub(r"[^a-z0-9-]+", "-", title.lower()).strip("-")[:40] or DEFAULT_FOLDER


def payload(dashboard: dict, folder: str, message: str = "trainguard dashboards push") -> dict:
    """The body of POST /api/dashboards/db: overwrite by uid, into the folder."""
    body = dict(dashboard, id=None)
    return {"dashboard": body, "folderUid": folder, "overwrite": True, "message": message}


def push(url: str, token: str, folder_title: str, policy, timeout: float = 15.0, mixin=None) -> list[str]:
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    from trainguard.dashboards import build

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)
    done = []
    try:
        uid = _ensure_folder(api, folder_title)
        for name, board in build.boards(policy, mixin).items():
            result = api.dashboard.update_dashboard(payload(board.to_json(), uid))
            done.append(f"{name}: {result.get('status', 'ok')} {url.rstrip('/')}{result.get('url', '')}")
    except GrafanaException as exc:
        raise PushError(f"{url}: Grafana answered {exc.status_code}: {exc.message}") from None
    except OSError as exc:
        raise PushError(f"{url}: cannot reach Grafana ({exc})") from None
    except Exception as exc:  # niquests' connection errors do not all derive from OSError
        if type(exc).__module__.startswith(("niquests", "urllib3", "requests")):
            raise PushError(f"{url}: cannot reach Grafana ({type(exc).__name__}: {exc})") from None
        raise
    return done


def _ensure_folder(api, title: str) -> str:
    for folder in api.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return api.folder.create_folder(title, uid=folder_uid(title))["uid"]
