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
    ],
)
def test_bad_launcher_options_are_one_line_user_errors(script, kwargs, message):
    with pytest.raises(UserError, match=message) as e:
        AttachConfig(target=script, **kwargs)
    assert "\n" not in str(e.value)


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
