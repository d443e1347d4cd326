"""The `user` mark stays whole: .ci/as-user runs only the fast tests marked `user` as an unprivileged account, so a
fast test that asks who runs it (root or not) and lacks the mark would lose its proof as that user."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what a test asks when its outcome or its path depends on the user (IS_ROOT: tests/eval/test_sandbox.py's name)
ASKS_WHO = re.compile(r"\bos\.(geteuid|getuid|getgid|getegid|getgroups)\(|\bIS_ROOT\b")
EUID = "os.geteuid()"  # in the self-test's fixture file only: this file's own tests ask nobody


def _marks(nodes: list[ast.expr]) -> set[str]:
    """The names X of every ``pytest.mark.X`` in ``nodes`` (decorators, or a ``pytestmark`` value)."""
    return {n.attr for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def unmarked_user_tests(root: Path = ROOT) -> list[str]:
    """Every fast test (no `integration` mark) that asks for the uid, gid or groups in its decorators or body but
    carries no `user` mark, itself or through its module's ``pytestmark``, as file:line."""
    bad = []
    for f in sorted((root / "tests").rglob("test_*.py")):
        text = f.read_text()
        tree = ast.parse(text)
        module = _marks([n.value for n in tree.body if isinstance(n, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)])
        tests = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.name.startswith("test_")]
        for t in tests:
            marks = module | _marks(t.decorator_list)
            source = "\n".join([*(ast.get_source_segment(text, d) or "" for d in t.decorator_list),
                                ast.get_source_segment(text, t) or ""])
            if "integration" not in marks and "user" not in marks and ASKS_WHO.search(source):
                bad.append(f"{f.relative_to(root)}:{t.lineno} {t.name}")
    return bad


def test_every_fast_test_that_asks_who_runs_it_is_marked_user():
    bad = unmarked_user_tests()
    assert not bad, ("these fast tests ask for the uid but lack @pytest.mark.user, so .ci/as-user never runs them "
                     f"as an unprivileged user: {bad}")


def test_the_check_sees_a_test_asking_for_the_uid(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import os, pytest\n"
        f"def test_a():\n    assert {EUID} >= 0\n"
        f"@pytest.mark.skipif({EUID} == 0, reason='root')\ndef test_b():\n    pass\n"
        f"@pytest.mark.user\ndef test_c():\n    assert {EUID} >= 0\n"
        f"@pytest.mark.integration\ndef test_d():\n    assert {EUID} >= 0\n"
        "def test_e():\n    pass\n")
    assert unmarked_user_tests(tmp_path) == ["tests/test_x.py:2 test_a", "tests/test_x.py:5 test_b"]
    (tmp_path / "tests" / "test_x.py").write_text("import os, pytest\npytestmark = [pytest.mark.user]\n"
                                                  f"def test_a():\n    assert {EUID} >= 0\n")
    assert unmarked_user_tests(tmp_path) == []
