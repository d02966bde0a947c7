"""Write a report directory atomically: report.json + report.html appear together or not at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgellm.runtime.errors import need
from edgellm.runtime.fileio import atomic_dir

from .report_html import render_html
from .report_json import dumps_report
from .verdict import add_verdict

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


def check_target(out_dir: Path) -> None:
    """Fail before any work if `out_dir` could not be written: it must be new, empty, or an earlier report."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        need(out_dir.is_dir(), f"-o {out_dir}: exists and is not a directory")
        need(not any(out_dir.iterdir()) or (out_dir / REPORT_JSON).is_file(),
             f"-o {out_dir}: exists and holds no {REPORT_JSON}, refusing to replace it (choose a new or empty "
             "directory)")


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Add the verdict (verdict.py) unless the report has one, fill a temporary sibling of `out_dir`, then
    rename it into place. An existing `out_dir` is replaced
    only if it holds a report.json (a mistyped -o never deletes an unrelated directory)."""
    out_dir = Path(out_dir)
    if "verdict" not in report:
        add_verdict(report)  # reads the exports' manifests (sizes, per-weight errors); the caller sees it too
    html = render_html(report)  # render first: a plotting error leaves nothing behind
    text = dumps_report(report)
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        out_dir.rmdir()  # an empty directory the user made for us is as good as none
    with atomic_dir(out_dir, marker=REPORT_JSON) as tmp:
        (tmp / REPORT_JSON).write_text(text, encoding="utf-8")
        (tmp / REPORT_HTML).write_text(html, encoding="utf-8")
    return out_dir
