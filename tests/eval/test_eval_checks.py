
import pytest
from conftest import REPO_ROOT

from mlbench_kit.dataset import load_samples
from mlbench_kit.eval.checks import check_output, param_hits_compat, param_hits_strict
from mlbench_kit.eval.static_cli import check_command
from mlbench_kit.eval.summary import gold_ceiling
from mlbench_kit.parse import parse_benchmark, parse_fenced
from mlbench_kit.passk import paired_difference, paper_pass_at_k, unbiased_pass_at_k

REPO = REPO_ROOT / "examples" / "sample" / "repos" / "toybench"


def test_gold_ceiling_on_the_real_test_split(shared):
    g = gold_ceiling(load_samples(shared / "full.jsonl"))
    assert g["ALL"] == {"rows": 260, "param_ok": 238, "type_ok": 259, "both": 237}
    assert sum(v["rows"] for k, v in g.items() if k != "ALL") == 260


def test_compat_parser_matches_the_benchmark_order():
    text = "Sure:\n```bash\npython a.py\n```\nor\n```python\nprint(1)\n```"
    assert parse_benchmark(text) == "\nprint(1)\n"  # python blocks win, wherever they are
    assert parse_benchmark("```\nls -l\n```") == "\nls -l\n"
    assert parse_benchmark("```\nunclosed") == "```\nunclosed"
    assert parse_benchmark("python a.py --x 1") == "python a.py --x 1"
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


@pytest.mark.parametrize("output, arguments, compat, strict", [
    # holes the benchmark's substring check leaves open
    ("python train.py --epochs 10", {"epochs": "1"}, True, False),
    ("python train.py --gpu 1 --embed_size 32", {"gpu": "3"}, True, False),  # dgl id 15's own answer
    ("python gan.py --rel_avg_gan  # --lr 0.0001", {"lr": "0.0001"}, True, False),  # PyTorch-GAN id 7's
    ("python train.py --epochs 0.001", {"lr": "0.001"}, True, False),
    # what the benchmark's loose labels mean, kept
    ("python extract.py esm2 x.fasta --repr_layers 25", {"layer_number": "25"}, True, True),
    ("python train.py --name label2city_512 --loadSize 512", {"resolusion size": "512"}, True, True),
    ("python train.py --lr 0.00001", {"learning rate": "1e-5"}, False, True),
    ("python test_pcn.py --num_points 256 --seed 42", {"seed": "--seed 42", "number of points": "256"}, True, True),
    ("python -u run.py --model_id PEMS-SF --data UEA", {"model_id": "PEMS", "data": "UEA"}, True, True),
    ("python -u run.py --data custom --data_path traffic.csv", {"data": "traffic"}, True, True),
    ("python -u eval_nsp.py ckpt.pt", {"argument1": "-u", "eval_file": "eval_nsp.py"}, True, True),
    ("python main.py --drop_edge_p 0 0.5", {"drop_edge_p": "0 0.5"}, True, True),
    ("python run_squad.py --predict_file=$SQUAD_DIR/dev-v2.0.json", {"version": "2.0"}, True, True),
    ("python generate.py --save_samples", {"save_samples": ""}, True, True),
])
def test_strict_closes_holes_and_keeps_loose_labels(output, arguments, compat, strict):
    assert all(param_hits_compat(output, arguments).values()) is compat
    assert all(param_hits_strict(output, arguments).values()) is strict


def test_strict_accepts_the_gold_answers_compat_accepts_but_three(shared):
    rejected = [(s.repo, s.id) for s in load_samples(shared / "full.jsonl")
                if all(param_hits_compat(s.output, s.arguments).values())
                and not all(param_hits_strict(s.output, s.arguments).values())]
    # each of the three is the answer's fault: a wrong --gpu, options in a comment, a value not in the command
    assert rejected == [("dgl", 15), ("PyTorch-GAN", 7), ("Time-Series-Library", 236)]


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


def test_a_paired_difference_is_over_the_rows_both_scored_and_shows_only_what_its_interval_excludes():
    F, T = False, True
    base = {1: [F, F, F, F], 2: [F, T, F, F], 3: [T, T, T, T], 4: [F, F, F, F], 9: [T, T, T, T]}
    better = {1: [T, F, F, F], 2: [T, T, T, F], 3: [T, T, T, T], 4: [T, T, F, F], 8: [F, F, F, F]}  # 9, 8: one side
    d = paired_difference(base, better, [1, 2])
    assert d["rows"] == 4
    assert d["pass@1"]["diff"] == 0.75 and d["pass@1"]["shown"] == "better"  # rows 1, 2, 4 each +1, row 3 0
    assert d["pass@2"]["diff"] == 0.5  # row 2 passed at 2 already: +0
    assert d["unbiased_pass@1"]["diff"] == round((0.25 + 0.5 + 0 + 0.5) / 4, 4)
    assert paired_difference(better, base, [1])["pass@1"]["shown"] == "worse"
    mixed = {1: [T, F], 2: [F, F], 3: [F, T]}  # one row up, one down: the interval holds 0
    assert paired_difference({1: [F, F], 2: [T, F], 3: [F, T]}, mixed, [1])["pass@1"]["shown"] == "neither"
    assert paired_difference({1: [T]}, {2: [T]}, [1]) == {
        "rows": 0, "pass@1": {"diff": None, "ci95": (0.0, 0.0), "shown": "neither"},
        "unbiased_pass@1": {"diff": None, "ci95": (0.0, 0.0), "shown": "neither"}}


def test_strict_reads_each_output_once_whatever_the_number_of_arguments(monkeypatch):
    """Issue 30 item 7: 1,000 numeric arguments cost 25 s of host CPU per answer; each argument scanned every word
    of the output for number literals (arguments x words). The output is now read once, each argument looked up."""
    from mlbench_kit.eval import checks

    scans = []

    class Counting:  # the same pattern, its scans counted
        def findall(self, text):
            scans.append(len(text))
            return NUMBER.findall(text)

    NUMBER = checks._NUMBER
    monkeypatch.setattr(checks, "_NUMBER", Counting())
    def name(i: int) -> str:
        return "opt" + "".join(chr(97 + int(d)) for d in str(i))

    output = "python train.py " + " ".join(f"--{name(i)} {i}" for i in range(1000)) + " --lr 0.01 && echo epochs 3"
    args = {f"argument{i}": str(i + 0.5) for i in range(256)} | {"epochs": "3", "learning rate": "1e-2",
                                                                 name(7): "7", "x": "999.0", "size": "999"}
    hits = param_hits_strict(output, args)
    # `--opt999 999` is the bare value of an option neither `x` nor `size` can name
    assert [k for k, ok in hits.items() if ok] == ["epochs", "learning rate", "opth"]
    assert sum(scans) <= 2 * len(output), f"{len(scans)} scans of {sum(scans)} characters"


_PARSE_RACE = """
import argparse, gc, sys, threading
from mlbench_kit.eval.checks import syntax_error
from mlbench_kit.eval.static_cli import script_options

script = sys.argv[1]  # a real script's argparse options after argparse's own source: a long parse
with open(script, "w") as f:
    f.write(open(argparse.__file__).read() + "\\nparser = ArgumentParser()\\nparser.add_argument('--lr')\\n")
second_parsed = threading.Event()
errors = []

class Pause:  # cyclic garbage: the collector runs its finalizer in the middle of the first thread's parse
    def __init__(self):
        self.me = self
    def __del__(self):
        second_parsed.wait(3)  # the other thread parses meanwhile, unless a lock holds it back

def checked(check):
    try:
        if not check():
            errors.append("misread")
    except Exception as exc:  # a thread that raised would otherwise end unseen
        errors.append(repr(exc))

def first():
    gc.collect()
    Pause()
    checked(lambda: script_options(script) is not None)

def second():
    checked(lambda: syntax_error(open(script).read(), as_shell=False) is None)
    second_parsed.set()

gc.set_threshold(1000, 1000, 1000)
threads = [threading.Thread(target=first), threading.Thread(target=second)]
for t in threads: t.start()
for t in threads: t.join()
print(sorted(set(errors))[:3], len(errors))
"""


def test_the_checks_parse_valid_code_alike_on_every_scoring_thread(tmp_path):
    """Eval scores on a thread pool; CPython 3.11's ``ast.parse`` raised SystemError for valid code when two threads
    parsed at once and the collector ran Python code mid-parse (CI failed on one such verdict). One thread's parse is
    paused by a finalizer while another parses: both still read the valid program."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _PARSE_RACE, str(tmp_path / "train.py")], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "0", r.stdout  # SystemError: AST constructor recursion depth mismatch, unlocked
