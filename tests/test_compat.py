"""The compatibility matrix builder (repro.compat): cells from the runner's JSON, reasons kept,
markdown rendering, bad input rejected -- on synthetic runner JSON -- and the committed
matrix, which must name every repro of the current registry (so it goes stale loudly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repro import discover
from repro.compat import (
    CELL_STATUSES,
    COMBINATIONS,
    Cell,
    Combination,
    CombinationResult,
    Matrix,
    cells_from_runner,
    render_markdown,
    venvs,
)
from repro.compat import run as compat_run
from repro.compat.combos import by_name
from repro.compat.render import cell_text

pytestmark = pytest.mark.cpu

COMMITTED = Path(__file__).parent.parent / "benchmarks" / "results" / "compat"
TITAN_PIN = "torchtitan 0.3.0 pins spmd_types==0.2.3"


def _path(status, detail=""):
    return {"status": status, "detail": detail, "seconds": 0.5}


def _outcome(name, unfixed, fixed):
    return {"name": name, "device": "cpu", "good": False, "unfixed": unfixed, "fixed": fixed}


RUNNER_JSON = [
    _outcome("mesh-recompute", _path("reproduced", "SpmdTypeError: requires an active mesh"),
             _path("passed", "completed")),
    _outcome("gone-upstream", _path("not-reproduced", "unfixed path completed"),
             _path("passed", "completed")),
    _outcome("fix-broke", _path("reproduced", "killed by SIGSEGV"),
             _path("failed", "WrongResult: gradients differ | by 1e-3")),
    _outcome("cuda-only", _path("skipped", "no cpu variant"), _path("skipped", "no cpu variant")),
    _outcome("needs-titan", _path("skipped", "missing torchtitan"), _path("skipped", "missing torchtitan")),
    _outcome("needs-both", _path("skipped", "missing torch_remat, torchtitan"),
             _path("skipped", "missing torch_remat, torchtitan")),
    _outcome("needs-verl080", _path("skipped", "verl 0.8.0 is not installed under /r; install it"),
             _path("passed", "completed")),
]


def _cells():
    return cells_from_runner(RUNNER_JSON, {"torchtitan": TITAN_PIN})


# --------------------------------------------------------------------------- cells


def test_cells_from_runner_json_keep_each_paths_verdict_and_reason():
    cells = _cells()
    assert list(cells) == [o["name"] for o in RUNNER_JSON]
    assert cells["mesh-recompute"].status == "ok"
    assert cells["gone-upstream"].status == "failed"
    assert cells["gone-upstream"].reason == "unfixed not-reproduced: unfixed path completed"
    assert cells["fix-broke"].status == "failed"
    assert cells["fix-broke"].reason == "fixed failed: WrongResult: gradients differ | by 1e-3"
    assert cells["fix-broke"].unfixed["detail"] == "killed by SIGSEGV"  # the good path kept too
    assert (cells["cuda-only"].status, cells["cuda-only"].reason) == ("skipped", "no cpu variant")


def test_a_module_left_out_on_purpose_reads_could_not_run_with_why():
    cells = _cells()
    assert (cells["needs-titan"].status, cells["needs-titan"].reason) == ("could-not-run", TITAN_PIN)
    assert cells["needs-both"].status == "could-not-run"  # torch_remat alone would be a skip
    assert cells["needs-verl080"].status == "skipped"  # no verl left out on purpose here
    only091 = Combination(name="x", python="3.11", torch="2.13.0", verl="0.9.1",
                          absent=(("torchtitan", TITAN_PIN),))
    verl_cell = cells_from_runner(RUNNER_JSON, only091.absent_reasons)["needs-verl080"]
    assert (verl_cell.status, verl_cell.reason) == (
        "could-not-run", "verl 0.8.0 is not in this combination (verl: 0.9.1)")
    assert verl_cell.fixed["status"] == "passed"  # each path's own verdict is kept
    without = cells_from_runner(RUNNER_JSON)  # a combination that leaves nothing out
    assert (without["needs-titan"].status, without["needs-titan"].reason) == (
        "skipped", "missing torchtitan")


@pytest.mark.parametrize("bad", [
    [{"name": "x", "unfixed": {"detail": "no status"}, "fixed": _path("passed")}],
    [{"name": "x", "fixed": _path("passed")}],
    [{"unfixed": _path("reproduced"), "fixed": _path("passed")}],
    {"name": "not a list"},
])
def test_malformed_runner_json_is_a_value_error(bad):
    with pytest.raises(ValueError):
        cells_from_runner(bad)


def test_cell_status_must_be_one_of_the_allowed():
    with pytest.raises(ValueError, match="could-not-install"):
        Cell("maybe")
    assert set(CELL_STATUSES) == {"ok", "failed", "skipped", "could-not-run", "could-not-install"}


# --------------------------------------------------------------------------- combinations


@pytest.mark.parametrize("field,value,allowed", [
    ("python", "3.10", "3.11"), ("verl", "0.7.0", "both"), ("torch", "2.15", "exact release"),
])
def test_combination_rejects_bad_values_naming_the_allowed(field, value, allowed):
    kwargs = {"name": "x", "python": "3.11", "torch": "2.13.0", field: value}
    with pytest.raises(ValueError, match=allowed):
        Combination(**kwargs)


def test_combination_names_a_verl_release_or_both():
    both = Combination(name="x", python="3.11", torch="2.13.0", verl="both")
    one = Combination(name="y", python="3.11", torch="2.13.0", verl="0.8.0")
    assert both.verl_versions == ("0.8.0", "0.9.1") and one.verl_versions == ("0.8.0",)
    assert Combination(name="z", python="3.11", torch="2.13.0").verl_versions == ()
    with pytest.raises(ValueError, match="torch="):
        Combination(name="w", python="3.11", torch="2.13.0", packages=("torch==2.15.0",))


def test_the_combinations_cover_the_released_versions():
    requested = " ".join(" ".join(c.requirements) for c in COMBINATIONS)
    for pin in ("torch==2.13.0", "torch==2.15.0", "spmd-types==0.2.3", "spmd-types==0.3.1",
                "megatron-core==0.16.1", "megatron-core==0.19.2", "torch-remat==0.2.2"):
        assert pin in requested
    assert {v for c in COMBINATIONS for v in c.verl_versions} == {"0.8.0", "0.9.1"}
    spmd031 = [c for c in COMBINATIONS if "spmd-types==0.3.1" in c.requirements]
    assert all(dict(c.absent).get("torchtitan") == TITAN_PIN for c in spmd031)
    assert {c.python for c in COMBINATIONS if "megatron-core==0.19.2" in c.requirements} == {"3.12"}
    with pytest.raises(ValueError, match="known: "):
        by_name(["nope"])
    with pytest.raises(ValueError, match="'cpu', 'cuda'"):
        by_name([], device="tpu")


def test_a_gpu_column_uses_the_hosts_own_torch(tmp_path, monkeypatch):
    (gpu,) = by_name([], device="cuda")
    assert gpu.torch == "system" and not any(r.startswith("torch==") for r in gpu.requirements)
    assert by_name([gpu.name], device="cuda") == (gpu,)
    combo = _this_python_combo()
    system = Combination(name="sys", python=combo.python, torch="system", packages=("numpy",))
    made = {}
    monkeypatch.setattr(venvs, "create_venv", lambda base, venv, system_site=False: made.update(
        system_site=system_site) or venv.mkdir() or venvs.venv_python(venv))
    monkeypatch.setattr(venvs, "_run", lambda argv, c, repo: made.update(args=argv[1:]) or
                        subprocess.CompletedProcess(argv, 0, "", ""))
    # pip even where uv is at hand: pip counts the host's torch (system site-packages) as installed
    assert venvs.ensure_venv(system, tmp_path, Path.cwd(), uv="/bin/uv").ok
    assert made == {"system_site": True, "args": ["-m", "pip", "install", "--progress-bar", "off",
                                                  "numpy"]}


def test_uv_installs_a_combinations_own_torch_with_pips_local_wheels(monkeypatch):
    combo = Combination(name="probe", python="3.11", torch="2.13.0", packages=("numpy",),
                        lift_pip_cap=True)
    python = Path("/v/bin/python")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /more")
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    assert venvs.install_command(python, combo, "/bin/uv") == [
        "/bin/uv", "pip", "install", "--python", "/v/bin/python", "--find-links", "/opt/wheels",
        "--find-links", "/more", "torch==2.13.0", "numpy"]
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # --wheels: offline for uv too
    assert "--no-index" in venvs.install_command(python, combo, "/bin/uv")
    assert venvs.install_command(python, combo, None)[:3] == ["/v/bin/python", "-m", "pip"]
    monkeypatch.setenv("UV_CONSTRAINT", "ci/constraints-cpu.txt")  # tox's pin of torch 2.13.0
    seen = {}
    monkeypatch.setattr(venvs.subprocess, "run", lambda argv, **kw: seen.update(kw["env"]))
    venvs._run(["/bin/uv", "pip", "install"], combo, Path.cwd())
    assert "UV_CONSTRAINT" not in seen and seen["PIP_CONFIG_FILE"] == os.devnull
    uv_error = "  × No solution found when resolving dependencies:\n  ╰─▶ Because torch==9.9.9 ..."
    assert venvs.last_error_line(uv_error) == "╰─▶ Because torch==9.9.9 ..."
    assert venvs.last_error_line("Resolved\nerror: Failed to fetch\nhint") == "error: Failed to fetch"


# --------------------------------------------------------------------------- matrix + markdown


def _result(name, cells=None, failure=None):
    return CombinationResult(name, "3.11", ["torch==2.13.0"], "both", "2026-11-30T12:00Z",
                             installed={"torch": "2.13.0+cpu"}, cells=cells or {}, failure=failure)


def test_matrix_rows_failures_and_merge():
    cells = _cells()
    older = _result("old", {"mesh-recompute": cells["mesh-recompute"]})
    broken = _result("broken", failure=Cell("could-not-install",
                                            "ERROR: No matching distribution found for torch==9.9.9"))
    matrix = Matrix("2026-11-30T12:00Z", "abc12345", "cpu", [_result("new", cells), older, broken],
                    {"mesh-recompute": "old words"})
    assert matrix.repros == list(cells)
    assert matrix.cell("old", "fix-broke").status == "could-not-run"  # not in its registry
    assert matrix.cell("broken", "cuda-only").reason.endswith("torch==9.9.9")
    assert "broken/*" in matrix.problems() and "new/fix-broke" in matrix.problems()
    assert "new/cuda-only" not in matrix.problems()  # skipped is reported, not a failure
    again = Matrix.from_json(json.loads(json.dumps(matrix.to_json())))
    assert again.to_json() == matrix.to_json()
    replaced = matrix.merged(Matrix("later", "def", "cpu", [_result("old", cells)],
                                    {"mesh-recompute": "new words", "cuda-only": "x"}))
    assert [c.name for c in replaced.combinations] == ["new", "old", "broken"]  # in place
    assert [c.name for c in replaced.ordered([_result("broken"), _result("new")]).combinations] \
        == ["broken", "new", "old"]
    assert replaced.summaries == {"mesh-recompute": "new words", "cuda-only": "x"}
    assert replaced.cell("old", "fix-broke").status == "failed"
    with pytest.raises(ValueError, match="schema"):
        Matrix.from_json({"combinations": []})
    filled = Matrix("t", "c", "cpu", [_result(COMBINATIONS[0].name, cells)]).with_missing(
        COMBINATIONS, "no result")
    assert [c.name for c in filled.combinations] == [c.name for c in COMBINATIONS]
    assert filled.cell(COMBINATIONS[-1].name, "mesh-recompute").status == "could-not-run"
    with pytest.raises(ValueError, match="could-not-run"):
        _result("x", failure=Cell("failed", "a whole combination cannot fail one way"))


def test_markdown_table_shows_every_cell_with_its_reason():
    matrix = Matrix("2026-11-30T12:00Z", "abc12345", "cpu",
                    [_result("combo-a", _cells()),
                     _result("combo-b", failure=Cell("could-not-install", "ERROR: boom"))],
                    {"needs-titan": "a | piped summary"})
    matrix.combinations[0].commit = "feedbeef"
    md = render_markdown(matrix)
    assert "| `feedbeef` |" in md and "| `?` |" in md  # each combination's own checkout
    assert "- `needs-titan`: a \\| piped summary" in md
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| repro"))
    assert "`combo-a`" in header and "`combo-b`" in header
    table = lines[lines.index(header) + 2:]
    table = table[:table.index("")]
    row = {line.split("|")[1].strip(" `"): line for line in table}
    assert list(row) == list(_cells())
    assert "reproduced · fixed-passed" in row["mesh-recompute"]
    assert "could not install: ERROR: boom" in row["mesh-recompute"]
    assert f"could not run: {TITAN_PIN}" in row["needs-titan"]
    assert "skipped: no cpu variant" in row["cuda-only"]
    assert "FAILED: fixed failed: WrongResult: gradients differ \\| by 1e-3" in row["fix-broke"]
    assert all(line.count("|") - line.count("\\|") == 4 for line in row.values())  # 3 columns
    assert "2.13.0+cpu" in md and "abc12345" in md
    assert cell_text(Cell("skipped", "x" * 500)).endswith("…")


# --------------------------------------------------------------------------- venvs and runs


def test_pip_verdict_is_its_last_error_line():
    stderr = ("Collecting torch==9.9.9\nERROR: Could not find a version that satisfies the "
              "requirement torch==9.9.9\nERROR: No matching distribution found for torch==9.9.9\n")
    assert venvs.last_error_line(stderr) == "ERROR: No matching distribution found for torch==9.9.9"
    assert venvs.last_error_line("warning\nlast words\n\n") == "last words"
    assert venvs.last_error_line("") == "(no output)"


def _this_python_combo(**kwargs):
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version not in ("3.11", "3.12"):
        pytest.skip(f"Python {version} is not a compat Python")
    return Combination(name="probe", python=version, torch="2.13.0", **kwargs)


def test_install_failure_reports_pips_last_line_and_success_is_reused(tmp_path, monkeypatch):
    combo = _this_python_combo(verl="0.9.1")
    calls = []
    monkeypatch.setattr(venvs, "create_venv", lambda base, venv, system_site=False:
                        venv.mkdir(exist_ok=True) or venvs.venv_python(venv))

    def fake_run(argv, combination, repo):
        args = argv[1:]
        calls.append(args)
        code = 1 if "repro.verl_release" in args else 0
        return subprocess.CompletedProcess(args, code, "", "ERROR: No matching distribution found "
                                           "for verl==0.9.1\n" if code else "")

    monkeypatch.setattr(venvs, "_run", fake_run)
    failed = venvs.ensure_venv(combo, tmp_path, Path.cwd())
    assert not failed.ok and failed.error == "ERROR: No matching distribution found for verl==0.9.1"
    assert calls[0][-1] == "torch==2.13.0"
    assert calls[1][-3:] == ["--root", str(tmp_path / "probe" / venvs.VERL_DIR), "0.9.1"]
    assert not (tmp_path / "probe" / venvs.MARKER).exists()  # a failed venv is never reused

    monkeypatch.setattr(venvs, "_run", lambda *a: subprocess.CompletedProcess(a, 0, "", ""))
    built = venvs.ensure_venv(combo, tmp_path, Path.cwd())
    assert built.ok and not built.reused
    assert venvs.ensure_venv(combo, tmp_path, Path.cwd()).reused
    changed = Combination(name="probe", python=combo.python, torch="2.15.0", lift_pip_cap=True)
    assert not venvs.ensure_venv(changed, tmp_path, Path.cwd()).reused  # another spec rebuilds


def test_run_combination_turns_runner_json_into_cells(tmp_path, monkeypatch):
    combo = Combination(name="probe", python="3.11", torch="2.13.0",
                        absent=(("torchtitan", TITAN_PIN),))
    (tmp_path / "probe").mkdir()
    monkeypatch.setattr(compat_run, "ensure_venv",
                        lambda c, root, repo, reinstall, uv: venvs.Install(True, sys.executable, 1.0))
    monkeypatch.setattr(compat_run, "installed_versions", lambda venv: {"torch": "2.13.0"})
    seen = {}

    def fake_runner(argv, **kwargs):
        if argv[0] == "git":  # subprocess.run is patched for everyone: the checkout's commit
            return subprocess.CompletedProcess(argv, 128, "", "not a git repository")
        seen.update(argv=argv, env=kwargs["env"])
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(RUNNER_JSON))
        return subprocess.CompletedProcess(argv, 1, "table", "")  # bad repros: exit 1

    monkeypatch.setattr(compat_run.subprocess, "run", fake_runner)
    monkeypatch.setenv("STACKFIX_MEGATRON_LM", str(tmp_path / "Megatron-LM"))
    result = compat_run.run_combination(combo, tmp_path, Path.cwd(), log=lambda m: None)
    assert seen["argv"][1:5] == ["-m", "repro", "--device", "cpu"]
    assert result.installed["megatron-lm-dev"].startswith("Megatron-LM (unknown")
    assert seen["env"]["STACKFIX_VERL_ROOT"] == str(tmp_path / "probe" / venvs.VERL_DIR)
    assert result.failure is None and result.cells["needs-titan"].reason == TITAN_PIN

    def dying_runner(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "Traceback\nImportError: no spmd_types\n")

    monkeypatch.delenv("STACKFIX_MEGATRON_LM")
    monkeypatch.setattr(compat_run.subprocess, "run", dying_runner)
    result = compat_run.run_combination(combo, tmp_path, Path.cwd(), log=lambda m: None)
    assert result.failure.status == "could-not-run"
    assert "runner exit 1: ImportError: no spmd_types" in result.failure.reason


def test_summaries_come_from_the_runners_list():
    summaries = compat_run.repro_summaries(sys.executable, Path(__file__).parent.parent)
    assert summaries.keys() == discover().keys()
    assert all(summaries[name] == r.summary for name, r in discover().items())


# --------------------------------------------------------------------------- the committed matrix


def test_ci_workflow_runs_every_combination():
    workflow = (Path(__file__).parent.parent / "ci" / "compat.yml").read_text()
    missing = [c.name for c in COMBINATIONS if f"- {c.name}\n" not in workflow]
    assert not missing, f"ci/compat.yml does not run {missing}"
    from repro.compat.upstream import PROJECTS

    for project in PROJECTS:  # and each upstream main as a checkout cell
        assert f"- {project}=https://github.com/" in workflow, project
    assert '--checkout "${spec%%=*}=$RUNNER_TEMP/upstream"' in workflow
    assert "schedule:" in workflow and "workflow_dispatch:" in workflow
    # and whenever a repro, a fix or the matrix's own code changes on main
    push = workflow.split("push:", 1)[1].split("jobs:", 1)[0]
    for path in ("repro/**", "fixes/**"):
        assert f'"{path}"' in push, f"ci/compat.yml: push does not watch {path}"


def test_committed_matrix_names_every_repro_of_the_registry():
    matrix = Matrix.from_json(json.loads((COMMITTED / "matrix.json").read_text()))
    missing = sorted(set(discover()) - set(matrix.repros))
    assert not missing, (f"benchmarks/results/compat/matrix.json predates repros {missing}: "
                         "regenerate it with `tox -m compat`")
    from repro.compat.upstream import is_upstream_cell

    names = {c.name for c in matrix.combinations}
    assert {c.name for c in COMBINATIONS} <= names  # every released combination, plus
    assert all(is_upstream_cell(n) for n in names - {c.name for c in COMBINATIONS})  # checkouts
    for combo in matrix.combinations:
        assert combo.failure is not None or combo.installed, f"{combo.name}: no versions recorded"
    assert (COMMITTED / "matrix.md").read_text() == render_markdown(matrix)


def test_the_readme_says_which_commit_the_committed_matrix_describes():
    from repro.compat.render import README_BEGIN, README_END, readme_summary

    matrix = Matrix.from_json(json.loads((COMMITTED / "matrix.json").read_text()))
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    # (then, where fixes/ or repro/ changed after it, benchmarks.headline's "older than the code")
    assert block.startswith(readme_summary(matrix)), \
        "regenerate with `tox -m compat` (it rewrites both)"
    assert f"commit `{matrix.commit}`" in block


# --- upstream checkouts as cells (repro.compat.upstream) ------------------------------------------


def _git_checkout(path: Path, name: str) -> str:
    path.mkdir()
    (path / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.0.1"\n')
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_checkout_replaces_the_released_package_in_its_cell(tmp_path):
    from repro.compat.upstream import parse_checkout, upstream_combination

    commit = _git_checkout(tmp_path / "tt", "torchtitan")
    project, path = parse_checkout(f"torchtitan={tmp_path / 'tt'}")
    combo, got = upstream_combination(project, path)
    assert got == commit and combo.name == f"{COMBINATIONS[0].name}-torchtitan-{commit[:8]}"
    from repro.compat.upstream import is_upstream_cell

    assert is_upstream_cell(combo.name) and not is_upstream_cell(COMBINATIONS[0].name)
    assert f"torchtitan @ file://{tmp_path / 'tt'}" in combo.packages
    assert not any(p.startswith("torchtitan==") for p in combo.packages)
    assert combo.torch == COMBINATIONS[0].torch and combo.verl == COMBINATIONS[0].verl


def test_a_megatron_lm_checkout_replaces_megatron_core_on_python_3_12(tmp_path):
    from repro.compat.upstream import upstream_combination

    _git_checkout(tmp_path / "mlm", "megatron-core")
    combo, _ = upstream_combination("megatron-lm", tmp_path / "mlm")
    assert combo.python == "3.12"  # Megatron-LM main requires Python >= 3.12
    assert [p for p in combo.packages if "megatron" in p] == [
        f"megatron-core @ file://{tmp_path / 'mlm'}"]


@pytest.mark.parametrize("spec,match", [("verl=.", "verl checkouts are not cells"),
                                        ("torchtitan", "NAME=PATH"),
                                        ("torchtitan=/nonexistent", "no pyproject.toml")])
def test_a_bad_checkout_is_refused_naming_what_is_allowed(spec, match):
    from repro.compat.upstream import parse_checkout

    with pytest.raises(ValueError, match=match):
        parse_checkout(spec)


def test_a_tree_without_git_is_refused_a_cell_must_name_its_commit(tmp_path):
    from repro.compat.upstream import upstream_combination

    (tmp_path / "pyproject.toml").write_text("")
    with pytest.raises(ValueError, match="not a git checkout"):
        upstream_combination("torchtitan", tmp_path)


def test_a_run_is_dirty_only_where_the_code_it_runs_changed(tmp_path, monkeypatch):
    """The matrix and README a previous run wrote leave the next run's commit clean; an
    uncommitted change under fixes/ or repro/ (a new file too) makes it -dirty."""
    import repro.compat.__main__ as driver

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for name in ("fixes/a.py", "repro/b.py", "README.md", "benchmarks/results/compat/matrix.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(driver, "REPO", tmp_path)
    (tmp_path / "README.md").write_text("the compat line\n")
    (tmp_path / "benchmarks/results/compat/matrix.md").write_text("a new matrix\n")
    assert not driver._commit().endswith("-dirty")
    (tmp_path / "repro/new.py").write_text("y\n")
    assert driver._commit().endswith("-dirty")
