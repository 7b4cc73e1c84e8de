"""The quirk registry: each row matches where it should and nowhere else; the user wins; opt-outs work."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from levers9.distributed.hardware import cards, quirk_checks, quirk_rows, quirks
from levers9.distributed.hardware.cards import Inventory
from levers9.distributed.hardware.nccl import NcclInfo
from levers9.distributed.hardware.quirk_checks import Platform
from levers9.distributed.hardware.quirk_rows import Match, Quirk
from levers9.distributed.hardware.quirks import plan_quirks
from levers9.errors import ConfigError, QuirkError
from tests.fakes import build_fake_nccl, build_fake_nccl_wheel, use_fake_pynvml
from tests.fakes.machines import (
    B200,
    FAKES_DIR,
    H100,
    L40S,
    RTX_4090,
    RTX_5090,
    RTX_6000_ADA,
    RTX_PRO_6000_SERVER,
    RTX_PRO_6000_WS,
    machine,
)
from tests.proc_util import board_folders_of

pytestmark = pytest.mark.fast

PLAIN = Platform(shm_bytes=64 * 1024**3, kernel_cmdline="quiet")  # Linux, big /dev/shm, not WSL, not ROCm
GOOD_NCCL = NcclInfo(
    (2, 27, 5), "/x/nvidia/nccl/lib/libnccl.so.2", "wheel", "nvidia-nccl-cu12", "2.27.5", (12, 9)
)
TORCH27_NCCL = NcclInfo(
    (2, 26, 2), "/x/nvidia/nccl/lib/libnccl.so.2", "wheel", "nvidia-nccl-cu12", "2.26.2", (12, 2)
)


def inv(monkeypatch: pytest.MonkeyPatch, *specs, **kw) -> Inventory:  # type: ignore[no-untyped-def]
    """The inventory levers9 reads from a fake NVML describing these cards."""
    use_fake_pynvml(monkeypatch, machine(*specs, **kw))
    return cards.inventory({})


def plan(inventory: Inventory | None = None, lws: int = 1, backend: str = "nccl", **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("env", {})
    kw.setdefault("nccl", GOOD_NCCL)
    kw.setdefault("platform", PLAIN)
    return plan_quirks(local_world_size=lws, backend=backend, inventory=inventory or Inventory(), **kw)


def status(p: quirks.QuirkPlan, quirk_id: str) -> str:
    return next(o.status for o in p.outcomes if o.quirk.id == quirk_id)


# --- Q1 blackwell-nccl-kernels --------------------------------------------------------------------


def nccl_info(version: tuple[int, int, int], wheel: str | None, build: tuple[int, int] | None) -> NcclInfo:
    path = "/x/nvidia/nccl/lib/libnccl.so.2" if wheel else "/usr/lib/x86_64-linux-gnu/libnccl.so.2"
    return NcclInfo(
        version, path, "wheel" if wheel else "system", "nvidia-nccl-cu12" if wheel else None, wheel, build
    )


BLACKWELL_CASES = [
    # (card, runtime, wheel, build string CUDA, expect error)
    (RTX_PRO_6000_SERVER, (2, 26, 2), "2.26.2", (12, 2), True),  # torch 2.7's pin: the trap
    (RTX_PRO_6000_SERVER, (2, 26, 2), "2.26.2", None, True),  # same, build string unreadable
    (RTX_PRO_6000_SERVER, (2, 26, 2), "2.26.2.post1", None, False),  # the Blackwell rebuild
    (RTX_PRO_6000_SERVER, (2, 26, 2), "2.26.2.post1", (12, 8), False),
    (RTX_PRO_6000_SERVER, (2, 25, 1), "2.25.1.post1", (12, 8), True),  # has sm_120 code, not the shmem fix
    (RTX_PRO_6000_SERVER, (2, 21, 5), "2.21.5", (12, 4), True),  # torch 2.6
    (RTX_PRO_6000_SERVER, (2, 26, 5), "2.26.5", (12, 9), False),
    (RTX_PRO_6000_SERVER, (2, 27, 7), "2.27.7", (13, 0), False),  # cu13 wheels start here
    (RTX_PRO_6000_SERVER, (2, 26, 2), None, (12, 8), False),  # a system/NGC build with CUDA 12.8
    (RTX_PRO_6000_SERVER, (2, 25, 1), None, (12, 8), True),
    (RTX_5090, (2, 26, 2), "2.26.2", (12, 2), True),
    (B200, (2, 25, 1), "2.25.1.post1", None, False),  # sm_100 never had the shared-memory bug
    (B200, (2, 25, 1), "2.25.1", (12, 2), True),
    (B200, (2, 25, 1), None, (12, 8), False),
    (B200, (2, 26, 2), "2.26.2", (12, 2), True),
    (H100, (2, 21, 5), "2.21.5", (12, 4), False),  # not Blackwell: any NCCL
]


@pytest.mark.parametrize(("spec", "version", "wheel", "build", "error"), BLACKWELL_CASES)
def test_blackwell_nccl_threshold(monkeypatch, spec, version, wheel, build, error) -> None:  # type: ignore[no-untyped-def]
    p = plan(inv(monkeypatch, spec), nccl=nccl_info(version, wheel, build))
    assert status(p, "blackwell-nccl-kernels") == ("applies" if error else "does not apply")
    assert bool(p.errors) == error


def test_blackwell_error_names_card_nccl_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, RTX_PRO_6000_SERVER, RTX_PRO_6000_SERVER), lws=2, nccl=TORCH27_NCCL)
    with pytest.raises(QuirkError) as caught:
        p.raise_errors()
    text = str(caught.value)
    assert "NVIDIA RTX PRO 6000 Blackwell Server Edition" in text and "compute capability 12.0" in text
    assert "2.26.2+cuda12.2" in text and "nvidia-nccl-cu12 2.26.2" in text
    assert 'pip install -U "nvidia-nccl-cu12>=2.26.5"' in text and "torch>=2.8" in text
    assert "LEVERS9_DISABLE_QUIRKS=blackwell-nccl-kernels" in text


def test_blackwell_unknown_nccl_warns_instead_of_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, B200), nccl=NcclInfo(None, None, None, None, None, None))
    assert not p.errors and status(p, "blackwell-nccl-kernels") == "unknown"
    assert any("could not be checked" in w for w in p.warnings)


def test_an_unreadable_compute_capability_is_unknown_not_an_old_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML failing to read the capability of an RTX PRO 6000 must not make the Blackwell rows 'not apply'."""
    unread = (RTX_PRO_6000_SERVER[0], None, RTX_PRO_6000_SERVER[2])
    i = inv(monkeypatch, unread, unread)
    assert i.cards[0].compute_capability is None and "compute capability unknown" in i.cards[0].describe()
    p = plan(i, lws=2, nccl=TORCH27_NCCL)
    assert status(p, "blackwell-nccl-kernels") == "unknown" and status(p, "rtxpro6000-p2p") == "unknown"
    assert not p.errors and not p.set_env
    (warning,) = [w for w in p.warnings if w.startswith("[blackwell-nccl-kernels]")]
    assert "the compute capability of cards 0,1" in warning and "cannot be read" in warning
    # A readable Blackwell card beside it still decides: that one lacks kernels in this NCCL.
    mixed = plan(inv(monkeypatch, RTX_PRO_6000_SERVER, unread), lws=2, nccl=TORCH27_NCCL)
    assert status(mixed, "blackwell-nccl-kernels") == "applies" and status(mixed, "rtxpro6000-p2p") == "applies"


def test_blackwell_rule_ignores_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, RTX_PRO_6000_SERVER), backend="gloo", nccl=TORCH27_NCCL)
    assert not p.errors


def test_opt_out_by_argument_and_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    i = inv(monkeypatch, RTX_PRO_6000_SERVER)
    assert plan(i, nccl=TORCH27_NCCL).errors
    assert not plan(i, nccl=TORCH27_NCCL, disabled=["blackwell-nccl-kernels"]).errors
    by_env = plan(i, nccl=TORCH27_NCCL, env={"LEVERS9_DISABLE_QUIRKS": " blackwell-nccl-kernels , "})
    assert not by_env.errors and status(by_env, "blackwell-nccl-kernels") == "disabled"
    everything = plan(i, lws=2, nccl=TORCH27_NCCL, env={"LEVERS9_DISABLE_QUIRKS": "all"})
    assert not everything.errors and not everything.set_env and not everything.warnings


@pytest.mark.parametrize(
    ("kw", "where"),
    [
        ({"disabled": ["blackwell-nccl-kernels", "foo-typo"]}, "disable_quirks="),
        ({"env": {"LEVERS9_DISABLE_QUIRKS": " foo-typo , blackwell-nccl-kernels"}}, "LEVERS9_DISABLE_QUIRKS="),
    ],
)
def test_an_unknown_quirk_id_is_refused_naming_it_and_the_known_ids(kw: dict, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan(**kw)
    text = str(info.value)
    assert "'foo-typo'" in text and where in text and "'blackwell-nccl-kernels'" not in text
    assert all(q.id in text for q in quirk_rows.QUIRKS) and "'all'" in text


def test_check_quirk_ids_knows_registered_rows_and_all() -> None:
    quirks.check_quirk_ids(["all", "shm-too-small"])
    with pytest.raises(ConfigError, match="'my-row'"):
        quirks.check_quirk_ids(["my-row"])
    quirks.register_quirk(Quirk("my-row", "a user row", Match(), "info"))
    try:
        quirks.check_quirk_ids(["my-row"])
    finally:
        quirks.unregister_quirk("my-row")


@pytest.mark.timeout(60)
def test_run_refuses_an_unknown_disable_quirks_id_before_starting_anything() -> None:
    from levers9 import distributed as dist
    from tests import rankfns

    with pytest.raises(ConfigError, match="'no-such-id'"):
        dist.run(rankfns.describe, None, nprocs=2, disable_quirks=("no-such-id",))
    assert not board_folders_of(os.getpid()), "a board folder was made"


# --- Q2 rtxpro6000-p2p --------------------------------------------------------------------------


def test_rtx_pro_6000_gets_p2p_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, *[RTX_PRO_6000_WS] * 4), lws=4)
    assert p.set_env == {"NCCL_P2P_DISABLE": "1"}
    ((qid, sentence),) = p.applied
    assert qid == "rtxpro6000-p2p" and "iommu=pt" in sentence and "NVIDIA/nccl#1999" in sentence


@pytest.mark.parametrize(
    ("specs", "lws", "kw", "backend"),
    [
        ([RTX_PRO_6000_WS] * 4, 1, {}, "nccl"),  # one rank: no collective between cards
        ([RTX_PRO_6000_WS] * 2, 2, {"nvlink": [(0, 1)]}, "nccl"),  # with NVLink, leave P2P alone
        ([RTX_PRO_6000_WS] * 2, 2, {}, "gloo"),
        ([H100] * 2, 2, {}, "nccl"),
        ([RTX_6000_ADA] * 8, 8, {}, "nccl"),  # "RTX 6000" alone is not an RTX PRO 6000
    ],
)
def test_rtx_pro_6000_rule_does_not_match(monkeypatch, specs, lws, kw, backend) -> None:  # type: ignore[no-untyped-def]
    p = plan(inv(monkeypatch, *specs, **kw), lws=lws, backend=backend)
    assert status(p, "rtxpro6000-p2p") == "does not apply"


def test_user_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, *[RTX_PRO_6000_WS] * 2), lws=2, env={"NCCL_P2P_DISABLE": "0"})
    assert p.set_env == {} and p.applied == []
    outcome = next(o for o in p.outcomes if o.quirk.id == "rtxpro6000-p2p")
    assert outcome.status == "applies" and outcome.kept == {"NCCL_P2P_DISABLE": "0"}


def test_only_the_cards_in_use_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks use CUDA cards 0 and 1; which cards those are depends on CUDA_DEVICE_ORDER."""
    use_fake_pynvml(monkeypatch, machine(H100, H100, RTX_PRO_6000_SERVER))
    pci = cards.inventory({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})  # H100, H100, PRO
    assert status(plan(pci, lws=2), "rtxpro6000-p2p") == "does not apply"
    assert status(plan(pci, lws=3), "rtxpro6000-p2p") == "applies"
    fastest = cards.inventory({})  # newest architecture first: PRO, H100, H100
    assert status(plan(fastest, lws=2), "rtxpro6000-p2p") == "applies"


# --- Q3 GeForce -----------------------------------------------------------------------------------


def test_geforce_old_driver_gets_p2p_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    old = plan(inv(monkeypatch, RTX_4090, RTX_4090, driver="535.104.05"), lws=2)
    assert old.set_env == {"NCCL_P2P_DISABLE": "1"} and old.applied[0][0] == "geforce-p2p-old-driver"
    new = plan(inv(monkeypatch, RTX_4090, RTX_4090, driver="550.40.07", p2p=5), lws=2)
    assert new.set_env == {} and not new.warnings


def test_geforce_reporting_p2p_on_a_new_driver_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(inv(monkeypatch, RTX_5090, RTX_5090, driver="575.57.08", p2p=0), lws=2)
    assert p.set_env == {}
    assert [w for w in p.warnings if "[geforce-p2p-patched]" in w and "iommu=pt" in w]


# --- Q4 professional Ada --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "lws", "applies"), [(L40S, 2, True), (RTX_6000_ADA, 7, True), (L40S, 8, False), (L40S, 1, False)]
)
def test_ada_between_two_and_seven(monkeypatch, spec, lws, applies) -> None:  # type: ignore[no-untyped-def]
    p = plan(inv(monkeypatch, *[spec] * 8), lws=lws)
    assert status(p, "ada-p2p") == ("applies" if applies else "does not apply")
    assert (p.set_env == {"NCCL_P2P_DISABLE": "1"}) == applies


# --- Q5 small /dev/shm ----------------------------------------------------------------------------


def test_small_shm_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    small = Platform(shm_bytes=64 * 1024 * 1024)
    p = plan(inv(monkeypatch, H100, H100), lws=2, platform=small)
    assert len(p.errors) == 1
    text = p.errors[0]
    assert (
        "64 MiB" in text
        and "--shm-size=1g" in text
        and "medium: Memory" in text
        and "NCCL_SHM_DISABLE=1" in text
    )


@pytest.mark.parametrize(
    ("lws", "backend", "env", "shm"),
    [
        (1, "nccl", {}, 64),
        (2, "gloo", {}, 64),
        (2, "nccl", {"NCCL_SHM_DISABLE": "1"}, 64),
        (2, "nccl", {}, 1024),
    ],
)
def test_small_shm_rule_does_not_match(monkeypatch, lws, backend, env, shm) -> None:  # type: ignore[no-untyped-def]
    p = plan(
        inv(monkeypatch, H100, H100),
        lws=lws,
        backend=backend,
        env=env,
        platform=Platform(shm_bytes=shm * 1024 * 1024),
    )
    assert status(p, "shm-too-small") == "does not apply" and not p.errors


def test_shm_size_is_read_from_the_filesystem(tmp_path: Path) -> None:
    size = quirk_checks.shm_bytes(str(tmp_path))
    assert isinstance(size, int) and size > 0
    assert quirk_checks.shm_bytes(str(tmp_path / "missing")) is None


# --- Q6 WSL2, Q8 ROCm, Q9 timeouts ----------------------------------------------------------------


def test_wsl2_with_two_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    i = inv(monkeypatch, RTX_4090, RTX_4090, p2p=5)
    assert plan(i, lws=2, platform=Platform(wsl=True, shm_bytes=2**34)).set_env == {"NCCL_P2P_DISABLE": "1"}
    assert plan(i, lws=1, platform=Platform(wsl=True, shm_bytes=2**34)).set_env == {}
    assert plan(i, lws=2).set_env == {}


def test_rocm_rows() -> None:
    rocm = Platform(rocm="6.2.41133", shm_bytes=2**34, kernel_cmdline="BOOT_IMAGE=/vmlinuz quiet")
    p = plan(lws=2, platform=rocm)
    assert p.set_env == {"HSA_FORCE_FINE_GRAIN_PCIE": "1"}
    assert [w for w in p.warnings if "[rocm-iommu-pt]" in w and "GRUB_CMDLINE_LINUX" in w]
    fixed = plan(lws=2, platform=Platform(rocm="6.2", shm_bytes=2**34, kernel_cmdline="quiet iommu=pt"))
    assert not fixed.warnings
    assert plan(lws=2).set_env == {} and plan(lws=1, platform=rocm).set_env == {}


def test_finite_timeout_row_informs_only() -> None:
    p = plan(backend="gloo")
    assert status(p, "finite-init-timeout") == "applies"
    assert not p.applied and not p.warnings and not p.errors and not p.set_env


# --- registry and plan mechanics ------------------------------------------------------------------


def test_register_and_replace_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = Quirk(
        id="my-h100-knob",
        description="our cluster's H100 nodes need a knob",
        match=Match(name=r"\bH100\b"),
        action="set-env",
        set_env={"NCCL_IB_DISABLE": "1"},
        evidence=("our wiki",),
    )
    quiet_pro = Quirk(
        id="rtxpro6000-p2p", description="replaced", match=Match(name="never-matches"), action="info"
    )
    quirks.register_quirk(mine)
    quirks.register_quirk(quiet_pro)
    try:
        assert plan(inv(monkeypatch, H100, H100), lws=2).set_env == {"NCCL_IB_DISABLE": "1"}
        assert plan(inv(monkeypatch, RTX_PRO_6000_WS, RTX_PRO_6000_WS), lws=2).set_env == {}
    finally:
        quirks.unregister_quirk("my-h100-knob")
        quirks.unregister_quirk("rtxpro6000-p2p")
    assert plan(inv(monkeypatch, RTX_PRO_6000_WS, RTX_PRO_6000_WS), lws=2).set_env == {
        "NCCL_P2P_DISABLE": "1"
    }


def test_every_row_has_an_id_evidence_and_a_known_action() -> None:
    ids = [q.id for q in quirk_rows.QUIRKS]
    assert len(ids) == len(set(ids)) >= 9
    for q in quirk_rows.QUIRKS:
        assert q.evidence and q.description and q.action in ("set-env", "error", "warning", "info")
        assert (q.action == "set-env") == bool(q.set_env)


def test_log_says_what_was_applied(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    p = plan(inv(monkeypatch, RTX_PRO_6000_WS, RTX_PRO_6000_WS), lws=2)
    with caplog.at_level(logging.INFO, logger="levers9.quirks"):
        p.log()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # heard without configuring logging
    assert "NCCL_P2P_DISABLE=1" in caplog.records[0].getMessage()


def test_plan_on_this_machine_never_raises() -> None:
    """Whatever this box is, planning against it reads it and returns (CPU box: nothing applies but Q9)."""
    p = plan_quirks(local_world_size=2, backend="gloo")
    assert status(p, "finite-init-timeout") == "applies"


# --- apply_quirks, end to end in fresh processes ---------------------------------------------------

APPLY = textwrap.dedent(
    """
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
    import pynvml  # the fake stands in for a driver: with pynvml imported, levers9 asks it
    from levers9.distributed.hardware import quirks
    if os.environ.get("TEST_MARK_APPLIED"):
        from levers9 import runtime  # what each rank of distributed.run does: its parent applied the quirks
        runtime.begin(runtime.Runtime(quirks_from_parent=True))
    try:
        first = quirks.apply_quirks(local_world_size=2, backend="nccl", is_main=True, disabled=["shm-too-small"])
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        raise SystemExit(0)
    second = quirks.apply_quirks(local_world_size=2, backend="nccl", is_main=True)
    print(json.dumps({"same": first is second, "set": first.set_env, "p2p": os.environ.get("NCCL_P2P_DISABLE")}))
    """
)


def _apply(env_extra: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update({"PYTHONPATH": FAKES_DIR, **env_extra})
    out = subprocess.run(
        [sys.executable, "-c", APPLY], env=env, capture_output=True, text=True, check=True
    ).stdout
    lines = out.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.mark.procs
def test_apply_sets_defaults_once_and_logs(tmp_path: Path) -> None:
    build_fake_nccl(tmp_path, 22705, "2.27.5+cuda12.9")
    two_pro = machine(RTX_PRO_6000_SERVER, RTX_PRO_6000_SERVER)
    result, logs = _apply({"FAKE_PYNVML": two_pro, "LD_LIBRARY_PATH": str(tmp_path)})
    assert result == {"same": True, "set": {"NCCL_P2P_DISABLE": "1"}, "p2p": "1"}
    assert logs.count("LOG levers9.quirks [rtxpro6000-p2p] set NCCL_P2P_DISABLE=1") == 1
    kept, _ = _apply({"FAKE_PYNVML": two_pro, "LD_LIBRARY_PATH": str(tmp_path), "NCCL_P2P_DISABLE": "0"})
    assert kept["p2p"] == "0" and kept["set"] == {}
    marked, logs = _apply(
        {"FAKE_PYNVML": two_pro, "LD_LIBRARY_PATH": str(tmp_path), "TEST_MARK_APPLIED": "1"}
    )
    assert marked["set"] == {} and marked["p2p"] is None and "LOG" not in logs


PLANNED_ONCE = textwrap.dedent(
    """
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(name)s %(message)s")
    logging.getLogger("levers9.quirks").setLevel(logging.DEBUG)  # a plan that sets nothing logs at DEBUG
    from levers9 import distributed as dist
    from levers9.distributed.hardware import quirks
    from levers9.distributed.hardware.quirk_rows import Match, Quirk
    from tests import rankfns
    quirks.register_quirk(Quirk("test-knob", "a row of this test.", Match(min_local_world_size=1, backend=None),
                                "set-env", set_env={"LEVERS9_TEST_KNOB": "on"}, evidence=("this test",)))
    started = dist.run(rankfns.variable_on_every_rank, "LEVERS9_TEST_KNOB", nprocs=2, backend="gloo")
    caller = os.environ.get("LEVERS9_TEST_KNOB")
    in_place = dist.run(os.environ.get, "LEVERS9_TEST_KNOB", nprocs=1, backend="gloo")
    again = dist.run(rankfns.variable_on_every_rank, "LEVERS9_TEST_KNOB", nprocs=2, backend="gloo")
    print(json.dumps({"started": started, "caller": caller, "in_place": in_place, "again": again}))
    """
)


@pytest.mark.procs
def test_quirks_are_planned_once_then_handed_to_the_ranks_or_applied_here() -> None:
    """A run that starts ranks plans the quirks in the caller and hands their variables to the ranks (the caller's
    environment is left alone, no rank plans again); a run in place applies them here, once, and later runs plan
    nothing more: one log line per plan."""
    env = {k: v for k, v in os.environ.items() if k != "LEVERS9_TEST_KNOB"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", PLANNED_ONCE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == {"started": ["on", "on"], "caller": None, "in_place": "on", "again": ["on", "on"]}
    planned = [line for line in lines if "[test-knob]" in line]
    assert len(planned) == 2 and all("set LEVERS9_TEST_KNOB=on" in line for line in planned), out


@pytest.mark.procs
def test_apply_raises_before_any_collective_with_old_nccl(tmp_path: Path) -> None:
    """The old NCCL is planted as a wheel first on sys.path, where the lookup reads first on CPU and CUDA builds."""
    lib = build_fake_nccl_wheel(tmp_path / "old", "2.26.2", 22602, "2.26.2+cuda12.2")
    shadow = os.pathsep.join([str(tmp_path / "old"), FAKES_DIR])
    result, _ = _apply({"FAKE_PYNVML": machine(RTX_PRO_6000_SERVER), "PYTHONPATH": shadow})
    assert result["error"] == "QuirkError"
    assert "RTX PRO 6000" in result["message"] and "2.26.2+cuda12.2" in result["message"]
    assert str(lib) in result["message"]
    build_fake_nccl_wheel(tmp_path / "fixed", "2.26.2.post1", 22602, "2.26.2+cuda12.8")
    fixed = os.pathsep.join([str(tmp_path / "fixed"), FAKES_DIR])
    ok, _ = _apply({"FAKE_PYNVML": machine(RTX_PRO_6000_SERVER), "PYTHONPATH": fixed})
    assert "error" not in ok


AGENT_ENV = textwrap.dedent(
    """
    import json, os
    import pynvml  # the fake stands in for a driver
    from levers9 import runtime
    from levers9.runtime import GangContext, JobContext
    from levers9.distributed.hardware import quirks
    from levers9.launch import job_process
    gang = GangContext("127.0.0.1", 1, ("10.0.0.1", "10.0.0.2"), (2, 2), node_index=1)
    job = JobContext("run", 0, 1, "/nonexistent", gpu_count=2, gpu_type="RTXPro6000", gang=gang)
    given = json.loads(os.environ["TEST_RANKS_ENV"])
    env = job_process.quirk_env(job, given)
    print(json.dumps({"env": env, "p2p_here": os.environ.get("NCCL_P2P_DISABLE"),
                      "applied_here": quirks.quirks_applied()}))
    """
)


@pytest.mark.procs
@pytest.mark.parametrize(
    ("ranks_env", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"NCCL_P2P_DISABLE": "1"}),
        ({"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "0"}, {}),  # the job's env= wins
    ],
)
def test_a_further_nodes_agent_hands_its_cards_quirks_to_its_ranks(
    tmp_path: Path, ranks_env: dict[str, str], expected: dict[str, str]
) -> None:
    """The agent of node 1 of a job across nodes plans for its own cards and hands the plan to the ranks it
    starts, leaving its own process (a Ray worker later tasks reuse) as it was."""
    build_fake_nccl(tmp_path, 22705, "2.27.5+cuda12.9")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH", "NCCL_P2P_DISABLE")}
    env.update(PYTHONPATH=FAKES_DIR, LD_LIBRARY_PATH=str(tmp_path), TEST_RANKS_ENV=json.dumps(ranks_env),
               FAKE_PYNVML=machine(RTX_PRO_6000_SERVER, RTX_PRO_6000_SERVER))  # fmt: skip
    out = subprocess.run([sys.executable, "-c", AGENT_ENV], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"env": expected, "p2p_here": None, "applied_here": False}
