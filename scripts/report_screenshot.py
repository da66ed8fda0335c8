"""Make docs/report-397b.png, the README's picture of `qtool report`: the sparse real-scale 397B layout
(NVIDIA's NVFP4 export: every header real, the data holes) reported and opened in headless Chromium.

    .venv/bin/python scripts/report_screenshot.py [--out docs/report-397b.png] [--height 2300]

Needs chromium (apt-get install chromium) or QTOOL_CHROMIUM. The sparse checkpoint takes ~234 GB of
apparent size and a few MB of disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/report-397b.png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1500)
    args = ap.parse_args()
    browser = os.environ.get("QTOOL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium: apt-get install chromium (or set QTOOL_CHROMIUM)", file=sys.stderr)
        return 1
    from qtool.cli.main import main as qtool
    from qtool.fixtures.sparse import build_sparse

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_sparse(Path(tmp) / "Qwen3.5-397B-A17B-NVFP4", model="397b", flavour="modelopt-nvfp4")
        page = Path(tmp) / "report.html"
        here = os.getcwd()
        os.chdir(tmp)  # the page names the checkpoint as given: its name, not the temporary directory
        try:
            rc = qtool(["report", ckpt.name, "-o", str(page), "--max-model-len", "262144"])
        finally:
            os.chdir(here)
        if rc != 0:
            return rc
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--window-size={args.width},{args.height}",
                f"--screenshot={os.path.abspath(args.out)}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
