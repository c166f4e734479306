"""An asv dashboard that renders without internet access.

asv 0.6's published index.html loads jQuery, flot, bootstrap and three small plugins from public CDNs; offline
(GPU runners, CI) the page shows only "Can not determine continental origin of swallow". `fetch` installs the
same libraries from the npm registry into .asv/dashboard-js (run by .ci/install); `vendor HTML_DIR` copies them
next to a published index.html and points its tags there.

    python3 -m perf.asv_benchmarks.offline fetch
    python3 -m perf.asv_benchmarks.offline vendor .asv/html

No benchmarks here: asv imports this module while discovering and finds nothing to run.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

JS_DIR = Path(__file__).resolve().parents[2] / ".asv" / "dashboard-js"

# The versions asv 0.6.6's index.html names (stupidtable 1.0.1 is not on npm; 1.1.3 has the same API).
NPM_PACKAGES = ("jquery@3.3.1", "flot@0.8.3", "flot-orderbars@1.0.0", "stupid-table-plugin@1.1.3",
                "blueimp-md5@2.19.0", "bootstrap@3.1.1")

# CDN file name -> file under node_modules (flot's npm package ships unminified files only).
FILES = {
    "jquery-3.3.1.min.js": "jquery/dist/jquery.min.js",
    "jquery.flot.min.js": "flot/jquery.flot.js",
    "jquery.flot.time.min.js": "flot/jquery.flot.time.js",
    "jquery.flot.selection.min.js": "flot/jquery.flot.selection.js",
    "jquery.flot.categories.min.js": "flot/jquery.flot.categories.js",
    "jquery.flot.orderBars.js": "flot-orderbars/js/jquery.flot.orderBars.js",
    "stupidtable.min.js": "stupid-table-plugin/stupidtable.min.js",
    "md5.min.js": "blueimp-md5/js/md5.min.js",
    "bootstrap.min.js": "bootstrap/dist/js/bootstrap.min.js",
    "bootstrap.min.css": "bootstrap/dist/css/bootstrap.min.css",
}

_REMOTE = re.compile(r'(src|href)="(https?://[^"]+\.(?:js|css))"')


def missing(js_dir: Path = JS_DIR) -> list[str]:
    return [f for f in FILES.values() if not (js_dir / "node_modules" / f).is_file()]


def fetch(js_dir: Path = JS_DIR) -> None:
    if not missing(js_dir):
        return  # already there: no registry needed
    js_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(js_dir), "--no-audit", "--no-fund", "--no-package-lock",
                    "--loglevel=error", *NPM_PACKAGES], check=True)
    if missing(js_dir):
        raise SystemExit(f"npm installed the packages but these files are missing: {missing(js_dir)}")


def vendor(html_dir: Path, js_dir: Path = JS_DIR) -> list[str]:
    """Rewrite html_dir/index.html to load local copies; return the file names replaced. Raises KeyError for a
    remote file this module does not know (a newer asv), rather than leaving a page that cannot render."""
    if missing(js_dir):
        raise FileNotFoundError(f"{js_dir} lacks {missing(js_dir)}: run `python3 -m perf.asv_benchmarks.offline fetch`")
    index = Path(html_dir) / "index.html"
    text = index.read_text()
    (index.parent / "vendor").mkdir(exist_ok=True)
    replaced = []

    def local(m):
        name = m.group(2).rsplit("/", 1)[1]
        if name not in FILES:
            raise KeyError(f"{index} loads {m.group(2)}, which has no local copy in {__name__}.FILES")
        shutil.copyfile(js_dir / "node_modules" / FILES[name], index.parent / "vendor" / name)
        replaced.append(name)
        return f'{m.group(1)}="vendor/{name}"'

    text = _REMOTE.sub(local, text)
    # Subresource-integrity hashes name the CDN's bytes; the local copies are served from the same origin.
    text = re.sub(r'\s(?:integrity|crossorigin|referrerpolicy)="[^"]*"', "", text)
    index.write_text(text)
    return replaced


def main(argv: list[str]) -> None:
    if argv[:1] == ["fetch"] and len(argv) == 1:
        fetch()
    elif argv[:1] == ["vendor"] and len(argv) == 2:
        print(f"{argv[1]}/index.html: local copies of {', '.join(vendor(Path(argv[1])))}")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
