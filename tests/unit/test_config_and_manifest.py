"""Tier 1 (pure): launcher option validation, torchrun argv, secret redaction."""

from __future__ import annotations

import pytest

from distdebug.artifacts.redact import REDACTED, redact_argv, redact_env
from distdebug.config import AttachConfig, parse_nnodes
from distdebug.errors import UserError
from distdebug.launch.attach import BOOTSTRAP_MODULE, torchrun_argv


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text("print('hi')\n")
    return str(p)


def test_torchrun_argv_runs_the_bootstrap_with_the_script_and_its_args(script):
    cfg = AttachConfig(target=script, target_args=["--lr", "3e-4"], nnodes="2", node_rank=1,
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400", rdzv_id="job")
    argv = torchrun_argv(cfg, "8")
    i = argv.index("-m")
    assert argv[i + 1] == BOOTSTRAP_MODULE
    assert argv[i + 2].endswith("train.py") and argv[i + 3:] == ["--lr", "3e-4"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:29400"
    assert argv[argv.index("--nproc-per-node") + 1] == "8"
    import torch.distributed.run as torchrun

    args = torchrun.parse_args(argv)  # torch's own parser accepts what we build
    assert args.module and args.training_script == BOOTSTRAP_MODULE
    assert args.training_script_args[1:] == ["--lr", "3e-4"]
    assert args.nnodes == "2" and args.rdzv_backend == "c10d"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc_per_node": "0"}, "--nproc-per-node must be a positive number"),
        ({"nproc_per_node": "lots"}, "--nproc-per-node must be a positive number"),
        ({"nnodes": "3:2"}, "--nnodes must be N or MIN:MAX"),
        ({"nnodes": "2"}, "needs a meeting point"),
        ({"nnodes": "2", "rdzv_endpoint": "h:1", "node_rank": 2}, "--node-rank 2 is outside 0..1"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"master_port": 70000}, "--master-port"),
        ({"rdzv_endpoint": "nohostport"}, "HOST:PORT"),
        ({"replica_groups": "0,1;1,2"}, "each rank .0 or more. may be in one group only"),
        ({"replica_groups": "0,a"}, "'0,a' is not a list of ranks"),
        ({"replica_groups": ";"}, "no group given"),
    ],
)
def test_bad_launcher_options_are_one_line_user_errors(script, kwargs, message):
    with pytest.raises(UserError, match=message) as e:
        AttachConfig(target=script, **kwargs)
    assert "\n" not in str(e.value)


def test_replica_groups_parse():
    from distdebug.config import parse_replica_groups

    assert parse_replica_groups("0,2;1,3") == [[0, 2], [1, 3]]
    assert parse_replica_groups(" 3, 1 ;0,2;") == [[1, 3], [0, 2]]


def test_missing_script(tmp_path):
    with pytest.raises(UserError, match="script not found"):
        AttachConfig(target=str(tmp_path / "nope.py"))


def test_module_target_is_not_checked_as_a_path():
    assert AttachConfig(target="recipes.ddp_convnet", module=True).module


def test_parse_nnodes():
    assert parse_nnodes("4") == (4, 4)
    assert parse_nnodes("1:3") == (1, 3)


def test_secret_env_names_are_redacted_names_kept():
    env = redact_env({"HF_TOKEN": "abc", "WANDB_API_KEY": "k", "db_password": "p", "AWS_SECRET_ACCESS_KEY": "s",
                      "MY_CREDENTIALS": "c", "NCCL_DEBUG": "INFO", "PATH": "/bin"})
    assert env["NCCL_DEBUG"] == "INFO" and env["PATH"] == "/bin"
    for name in ("HF_TOKEN", "WANDB_API_KEY", "db_password", "AWS_SECRET_ACCESS_KEY", "MY_CREDENTIALS"):
        assert env[name] == REDACTED


def test_secret_arguments_are_redacted():
    assert redact_argv(["train.py", "--api-key", "abc", "--hf-token=xyz", "--lr", "1"]) == [
        "train.py", "--api-key", REDACTED, f"--hf-token={REDACTED}", "--lr", "1"]


def test_secrets_are_redacted_by_value_too():
    from distdebug.artifacts.redact import Redactor, redact_text

    assert redact_text("postgres://u:PASSWORD@h/db and https://example.org/x") == \
        "postgres://<redacted>@h/db and https://example.org/x"
    assert redact_text("Authorization: Bearer abcdefgh12345678") == "Authorization: Bearer <redacted>"
    assert redact_text("token count 12, tokens/s") == "token count 12, tokens/s"  # ordinary words stay
    red = Redactor(env={"WANDB_API_KEY": "wandb-secret-1", "PATH": "/usr/bin"},
                   argv=["train.py", "--token", "tok-abc-123"])
    assert red("failed with wandb-secret-1 and tok-abc-123 on /usr/bin") == \
        "failed with <redacted> and <redacted> on /usr/bin"
    env = redact_env({"DATABASE_URL": "mysql://root:hunter22@db/x", "HF_TOKEN": "hf_x"})
    assert env == {"DATABASE_URL": "mysql://<redacted>@db/x", "HF_TOKEN": REDACTED}


# ------------------------------------------------------------------ detectors' options: one source of defaults
def test_detector_options_are_typed_by_the_detectors_config_and_defaults_come_from_it():
    from distdebug.config import LossSpikeConfig
    from distdebug.detectors import registry

    specs = registry.resolve(["loss_spike", "replica_divergence", "loss_nonfinite"],
                             {"loss_spike": {"window": "100"}},
                             {"replica_divergence": {"every": 4}, "loss_spike": {"window": 20, "threshold": 6.0},
                              "profiler": {"on_finding": 0}})  # profiler is not in this run: ignored
    assert specs == [
        {"target": "loss_spike", "params": {"threshold": 6.0, "window": 100}},  # --detector-option wins
        {"target": "replica_divergence", "params": {"every": 4, "state_every": 8}},
        {"target": "loss_nonfinite", "params": {}},
    ]
    built = registry.build(specs)
    assert (built[0].window, built[0].threshold, built[1].every) == (100, 6.0, 4)
    # Built without options, a detector has its dataclass's defaults: the same ones the CLI shows.
    (plain,) = registry.build(["loss_spike"])
    assert plain.config == LossSpikeConfig() and plain.window == LossSpikeConfig.window


def test_the_clis_defaults_are_the_dataclasses():
    from distdebug.cli import attach
    from distdebug.config import AttachConfig, LossSpikeConfig, ProfilerConfig, ReplicaDivergenceConfig, option_default

    opts = {p.name: p for p in attach.params}
    assert opts["stall_timeout"].default == option_default(AttachConfig, "stall_timeout") == 300.0
    assert opts["spike_threshold"].show_default == str(LossSpikeConfig().threshold)
    assert opts["spike_window"].show_default == str(LossSpikeConfig().window)
    assert opts["fingerprint_every"].show_default == str(ReplicaDivergenceConfig().every)
    assert opts["profile_on_finding"].show_default == str(ProfilerConfig().on_finding) == "5"
    # Unset on the command line, they send nothing: the rank builds the same defaults.
    assert all(opts[n].default is None for n in ("spike_threshold", "spike_window", "fingerprint_every",
                                                  "profile_steps", "profile_on_finding", "stop_on_nan"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_spike": {"windw": "5"}}, "detector loss_spike has no option 'windw'; it takes threshold, window"),
        ({"loss_spike": {"window": "many"}}, "loss_spike.window must be int, got 'many'"),
        ({"loss_spike": {"window": "5"}}, "--spike-window must be 10 steps or more, got 5"),
        ({"nan_origin": {"stop": "perhaps"}}, "nan_origin.stop must be bool, got 'perhaps'"),
        ({"straggler": {"x": "1"}}, "no detector 'straggler' in this run"),
        ({"loss_nonfinite": {"x": "1"}}, "detector loss_nonfinite takes no options"),
    ],
)
def test_bad_detector_options_are_one_line_user_errors(options, message):
    from distdebug.detectors import registry

    with pytest.raises(UserError, match=message) as e:
        registry.resolve(["loss_spike", "nan_origin", "loss_nonfinite"], options)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_detectors_minus_leaves_default_ones_out():
    # What the report's cost advice says to do: --detectors=-nan_origin keeps every other default one.
    from distdebug.detectors import registry
    from distdebug.errors import UserError

    defaults = registry.default_specs()
    assert registry.chosen(None) == defaults
    left_out = ("nan_origin", "straggler")
    assert registry.chosen(["-nan_origin", "-straggler"]) == [d for d in defaults if d not in left_out]
    assert registry.chosen(["loss_nonfinite"]) == ["loss_nonfinite"]
    for bad, says in ((["-nan_origin", "loss_spike"], "not both"), (["-nope"], "'nope' is not a default detector")):
        try:
            registry.chosen(bad)
        except UserError as e:
            assert says in str(e) and e.exit_code == 2
        else:
            raise AssertionError(bad)
