"""The documentation cannot drift: the MkDocs site builds in strict mode (a broken link, a missing anchor or a page
left out of the nav fails it), every command the docs show is parsed by the real command-line parsers, and the
README stays short."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlbench_kit.cli import stage_parser
from mlbench_kit.errors import MLBenchError

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")  # an info string holds no backtick
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def shell_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of each shell fence's lines: continuation lines (a trailing backslash) and lines
    inside an open quote joined."""
    fence: str | None = None
    pending, start = "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1) if m.group(2) in SHELL_FENCES else "skip:" + m.group(1)
            continue
        if m and m.group(1) == fence.removeprefix("skip:") and not m.group(2):
            fence, pending = None, ""
            continue
        if fence.startswith("skip:"):
            continue
        text = line.strip()
        if text.startswith("$ "):
            text = text[2:]
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        if not _complete(pending + text):
            pending += text + "\n"
            continue
        yield start, pending + text
        pending = ""


def commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line: split at operators and newlines, leading variable assignments and `exec`
    dropped; the script of `bash -c SCRIPT` (as under srun) is read as commands of its own."""
    lexer = shlex.shlex(line.replace("\\\n", " ").replace("\n", " ; "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for tok in [*lexer, ";"]:
        if tok not in _OPERATORS:
            words.append(tok)
            continue
        while words and (_ENV_ASSIGNMENT.match(words[0]) or words[0] in ("exec", "time")):
            words = words[1:]
        for i, w in enumerate(words[:-2]):
            if Path(w).name in ("bash", "sh") and words[i + 1] == "-c":
                yield from commands(words[i + 2])
                break
        else:
            if words:
                yield words
        words = []


def stage_argv(words: list[str]) -> tuple[str, list[str]] | None:
    """(stage, its arguments) of a command that runs mlbench: `mlbench STAGE ...`, `python3 -m mlbench_kit.cli
    STAGE ...`, or `[accelerate launch [OPTIONS]] [python3] train/lora.py ...` (the train stage); None otherwise."""
    if words[:1] in (["sudo"], ["flock"]):
        return None
    if words and Path(words[0]).name == "mlbench":
        return (words[1], words[2:]) if len(words) > 1 else ("", [])
    if len(words) >= 3 and re.fullmatch(r"python3?", Path(words[0]).name) and words[1] == "-m":
        if words[2] in ("mlbench_kit", "mlbench_kit.cli"):
            return (words[3], words[4:]) if len(words) > 3 else ("", [])
        if words[2] == "mlbench_kit.train.lora":
            return "train", words[3:]
        return None
    for i, w in enumerate(words):
        if w.endswith("train/lora.py") and (i == 0 or words[0] in ("accelerate", "python", "python3")):
            return "train", words[i + 1:]
    return None


def parse(stage: str, argv: list[str]) -> None:
    """Parse with the stage's own parser, as `mlbench STAGE` builds it; unknown flags and bad values raise."""
    if stage in ("-h", "--help") and not argv:  # `mlbench --help`
        return
    if stage == "--version" and not argv:
        return
    stage_parser(stage, raising=True).parse_args(argv)


def shown_commands(paths: list[Path]) -> list[tuple[str, str, list[str]]]:
    """(file:line, stage, arguments) of every mlbench command shown in a shell fence of these files."""
    found = []
    for path in paths:
        for n, line in shell_lines(path):
            for words in commands(line):
                got = stage_argv(words)
                if got:
                    found.append((f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}", *got))
    return found


def check_commands(paths: list[Path]) -> list[str]:
    """One message per shown command the parsers refuse, naming its file:line."""
    bad = []
    for where, stage, argv in shown_commands(paths):
        try:
            parse(stage, argv)
        except (MLBenchError, SystemExit) as exc:
            bad.append(f"{where}: mlbench {stage} {shlex.join(argv)}: {exc}")
    return bad


def test_every_shown_command_parses() -> None:
    found = shown_commands(doc_files())
    assert len(found) >= 30, f"only {len(found)} mlbench commands found in the docs: is the fence parser broken?"
    assert {stage for _, stage, _ in found} >= {"prep", "train", "infer", "env", "eval", "report", "sweep"}
    bad = check_commands(doc_files())
    assert not bad, "commands in the docs the CLI refuses:\n" + "\n".join(bad)


def test_a_made_up_flag_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\nmlbench eval --data d.jsonl \\\n    --generations g.jsonl --no-such-flag 1\n"
                    "accelerate launch --num_processes 2 train/lora.py --task 3 --lr-typo 1\n```\n\n"
                    "```python\nmlbench eval --ignored-here\n```\n")
    bad = check_commands([page])
    assert len(bad) == 2, bad
    assert bad[0].startswith(f"{page}:4: mlbench eval") and "--no-such-flag" in bad[0]
    assert bad[1].startswith(f"{page}:6: mlbench train") and "--lr-typo" in bad[1]


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move the depth to docs/ (at most {README_MAX_LINES})"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def dead_links(path: Path) -> list[str]:
    """Relative links of a Markdown file outside the site (the README) whose target file does not exist."""
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:|^#", target):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                bad.append(f"{path.name}:{n}: {target}")
    return bad


def test_readme_links_resolve(tmp_path: Path) -> None:
    assert not dead_links(ROOT / "README.md")
    broken = tmp_path / "README.md"
    broken.write_text("see [the page](docs/nowhere.md)\n")
    assert dead_links(broken) == ["README.md:1: docs/nowhere.md"]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:  # mkdocs: the dev extra, which setup.sh installs
    site = tmp_path_factory.mktemp("site")
    out = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert out.returncode == 0, out.stdout + out.stderr
    return site


def test_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()


# after the page's own scripts: how many code blocks are wider than their box (cut on the right)
_MEASURE_CUT = ("<script>document.body.setAttribute('data-cut', Array.from(document.querySelectorAll('pre, pre code'))"
                ".filter(function (p) { return p.scrollWidth > p.clientWidth + 1; }).length + '/' + "
                "document.querySelectorAll('pre').length);</script></body>")


def test_code_blocks_are_not_cut_at_1280_px(site: Path, tmp_path: Path) -> None:
    """Issue 43 item 7: the site's first code blocks were cut on the right at 1280 px (the theme's 800 px column;
    commands run to 135 characters). Measured in headless chromium on the pages with the widest commands."""
    from conftest import chromium_or_skip, dump_dom
    chromium = chromium_or_skip()
    for name in ("install", "infer"):
        page = site / name / "index.html"
        page.write_text(page.read_text().replace("</body>", _MEASURE_CUT, 1))
        dom, _ = dump_dom(chromium, page.as_uri(), tmp_path, "--window-size=1280,900")
        cut = re.search(r'data-cut="(\d+)/(\d+)"', dom)
        assert cut and int(cut.group(2)) > 0 and cut.group(1) == "0", (name, cut and cut.group(0))


def test_the_stage_table_and_the_nav() -> None:
    """docs/index.md's stage table has a row for every stage's command (agent's was missing), and the dated
    measurement pages sit in one nested nav section instead of filling the top of the navigation."""
    import yaml

    from mlbench_kit.stages import STAGES
    table = [x for x in (ROOT / "docs" / "index.md").read_text().split("## The stages")[1].split("\n\n")[1]
             .splitlines() if x.startswith("|")]
    missing = [st.name for st in STAGES if not any(f"`mlbench {st.name}`" in row for row in table)]
    assert missing == [], f"docs/index.md's stage table has no row for: {missing}"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    measurements = next(e["Measurements"] for e in nav if isinstance(e, dict) and "Measurements" in e)
    assert [next(iter(e)) for e in measurements] == ["Index", "Every measurement"]
    pages = [v for e in nav for v in (e.values() if isinstance(e, dict) else [e])]
    assert not [p for p in pages if isinstance(p, str) and p.startswith("results/")]


@pytest.mark.parametrize("breakage", ["dead link", "page not in nav"])
def test_site_build_fails_on_a_broken_page(tmp_path: Path, breakage: str) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", symlinks=True)
    shutil.copytree(ROOT / "bench" / "results", copy / "bench" / "results")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    if breakage == "dead link":
        page = copy / "docs" / "eval.md"
        page.write_text(page.read_text() + "\nSee [nothing](no-such-page.md).\n")
    else:
        (copy / "docs" / "orphan.md").write_text("# Not in the nav\n")
    out = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0, f"mkdocs build --strict passed with a {breakage}"
    assert ("no-such-page.md" if breakage == "dead link" else "orphan.md") in out.stdout + out.stderr
