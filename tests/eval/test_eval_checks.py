
import pytest
from conftest import REPO_ROOT
from mlbench_kit.eval.checks import check_output, param_hits_compat, param_hits_strict
from mlbench_kit.eval.metrics import paper_pass_at_k, unbiased_pass_at_k
from mlbench_kit.eval.run import gold_ceiling
from mlbench_kit.eval.static_cli import check_command

from mlbench_kit.dataset import load_samples
from mlbench_kit.parse import parse_compat, parse_fenced

REPO = REPO_ROOT / "examples" / "sample" / "repos" / "toybench"


def test_gold_ceiling_on_the_real_test_split(shared):
    g = gold_ceiling(load_samples(shared / "full.jsonl"))
    assert g["ALL"] == {"rows": 260, "param_ok": 238, "type_ok": 259, "both": 237}
    assert sum(v["rows"] for k, v in g.items() if k != "ALL") == 260


def test_compat_parser_matches_the_benchmark_order():
    text = "Sure:\n```bash\npython a.py\n```\nor\n```python\nprint(1)\n```"
    assert parse_compat(text) == "\nprint(1)\n"  # python blocks win, wherever they are
    assert parse_compat("```\nls -l\n```") == "\nls -l\n"
    assert parse_compat("```\nunclosed") == "```\nunclosed"
    assert parse_compat("python a.py --x 1") == "python a.py --x 1"
    assert parse_fenced("Here:\n```bash\npython a.py\n```\n```bash\necho b\n```") == "python a.py\necho b"
    assert parse_fenced("$ python a.py --lr 1") == "python a.py --lr 1"


def test_compat_vs_strict_parameter_checks():
    args = {"lr": "0.001", "dataset": "cora"}
    out = "python train.py --dataset cora --lr 1e-3"
    assert param_hits_compat(out, args) == {"lr": False, "dataset": True}
    assert param_hits_strict(out, args) == {"lr": True, "dataset": True}
    wrong_option = "python train.py --dataset pubmed --epochs 0.001 # cora"
    assert all(param_hits_compat(wrong_option, args).values())
    assert param_hits_strict(wrong_option, args) == {"lr": False, "dataset": False}
    assert param_hits_strict("bash scripts/run.sh cora gcn", {"argument1": "cora"}) == {"argument1": True}
    assert param_hits_strict("m = build_model('gat', hidden=16)", {"hidden": "16.0"}) == {"hidden": True}


def test_type_check_is_the_benchmarks():
    assert check_output("python a.py --x 1", {}, "Bash Script", "compat").type_ok
    assert not check_output("python a.py", {}, "Bash Script", "compat").type_ok  # no trailing space: not a script
    assert check_output("import os\nprint(os.getcwd())", {}, "Python Code", "compat").type_ok


def test_static_cli_check_finds_unknown_options_and_bad_choices():
    rep = check_command("python train.py --dataset reddit --lr 0.1 --optimizer adam", REPO)
    assert rep.script == "train.py"
    assert rep.unknown_options == ["--optimizer"]
    assert rep.invalid_choices == ["--dataset=reddit (choices: cora, citeseer, pubmed)"]
    assert check_command("python train.py --dataset cora --lr=-0.5", REPO).ok
    assert check_command("python missing.py --x 1", REPO) is None


def test_pass_at_k():
    assert paper_pass_at_k([False, True, False, False, False], 1) == 0.0
    assert paper_pass_at_k([False, True, False, False, False], 2) == 1.0
    assert unbiased_pass_at_k([False, True, False, False, False], 1) == pytest.approx(0.2)
    assert unbiased_pass_at_k([True, True, False, False, False], 2) == pytest.approx(1 - 3 / 10)
    assert unbiased_pass_at_k([True], 5) is None
