"""The docs stay true to the code: the flags page is what the parsers generate, the README
stays a front page, every relative link points at a file, every supported architecture
has its row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_flags_page_is_what_the_parsers_generate():
    result = subprocess.run([sys.executable, "scripts/engine_args_doc.py", "--check"], cwd=ROOT, timeout=300)
    assert result.returncode == 0, "docs/configuration/engine_args.md is stale: run python scripts/engine_args_doc.py"


def test_the_flags_page_lists_each_flag_once():
    rows = [line.split("|")[1].strip() for line in (ROOT / "docs/configuration/engine_args.md").read_text().splitlines()
            if line.startswith("| `-")]
    assert len(rows) > 80 and len(rows) == len(set(rows))
    assert any("`--max-num-seqs`" in row for row in rows) and any("`--tensor-parallel-size`" in row for row in rows)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert text.index("make serve") < 200 and "make test" in text[:300]


def test_every_relative_link_in_the_docs_points_at_a_file():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert len(PAGES) > 10 and broken == []


def test_the_models_table_is_what_the_family_records_generate():
    result = subprocess.run([sys.executable, "scripts/models_doc.py", "--check"], cwd=ROOT, timeout=300)
    assert result.returncode == 0, "docs/models/supported_models.md is stale: run python scripts/models_doc.py"


def test_every_supported_architecture_has_a_row_in_the_models_page():
    from services.worker.models.families.registry import (
        SUPPORTED_ARCHITECTURES,
        TEXT_MODELS_OF,
    )

    page = (ROOT / "docs/models/supported_models.md").read_text()
    missing = [arch for arch in [*SUPPORTED_ARCHITECTURES, *TEXT_MODELS_OF] if f"`{arch}`" not in page]
    assert missing == []
