"""README.md's generated blocks are what their commands print today (scripts/readme_outputs.py)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "readme_outputs.py"


@pytest.fixture(scope="module")
def readme_outputs():
    # scripts/ is not a package: the script is loaded from its file, as `make readme` runs it.
    spec = importlib.util.spec_from_file_location("readme_outputs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_current(readme_outputs, capsys):
    code = readme_outputs.main(["--check"])
    assert code == 0, f"README.md is stale, run `make readme`:\n{capsys.readouterr().out}"


def test_check_finds_a_stale_block(readme_outputs, tmp_path, capsys):
    readme = tmp_path / "README.md"
    stale = "intro\n\n<!-- generated: specpool --version -->\n```\n$ specpool --version\nspecpool 0.0.0\n```\n" \
            "<!-- end generated -->\n\nafter\n"
    readme.write_text(stale)
    assert readme_outputs.main(["--check", "--readme", str(readme)]) == 1
    assert "+specpool " in capsys.readouterr().out  # the diff shows the version it would write
    assert readme.read_text() == stale  # --check changes nothing

    assert readme_outputs.main(["--readme", str(readme)]) == 0
    assert readme_outputs.main(["--check", "--readme", str(readme)]) == 0
    assert readme.read_text().startswith("intro\n\n<!-- generated: specpool --version -->\n```\n$ specpool --version\n")


def test_render_rewrites_only_blocks(readme_outputs):
    text = "a\n<!-- generated: specpool x -->\n<!-- end generated -->\nb\n"
    rendered = readme_outputs.render(text, run=lambda command: f"out of {command}  \n\n")
    assert rendered == "a\n<!-- generated: specpool x -->\n```\n$ specpool x\nout of specpool x\n```\n" \
                       "<!-- end generated -->\nb\n"
    with pytest.raises(ValueError, match="end generated"):
        readme_outputs.render("<!-- generated: specpool x -->\nno end\n", run=str)
