"""terraform/: the module and its worked example validate offline against the provider mirror (terraform/cli.tfrc)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

TERRAFORM = Path(__file__).resolve().parents[2] / "terraform"
MIRROR = Path("/opt/tf-plugins")


@pytest.mark.skipif(shutil.which("terraform") is None or not MIRROR.is_dir(), reason="needs terraform and the provider mirror in /opt/tf-plugins")
def test_example_inits_offline_and_validates(tmp_path):
    shutil.copytree(TERRAFORM, tmp_path / "terraform")  # init writes a lock file and .terraform/ beside the config
    example = tmp_path / "terraform" / "examples" / "basic"
    env = os.environ | {"TF_CLI_CONFIG_FILE": str(TERRAFORM / "cli.tfrc"), "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}

    def terraform(*args: str) -> str:
        result = subprocess.run(["terraform", *args], cwd=example, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"terraform {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    assert "hashicorp/aws" in terraform("init", "-backend=false", "-input=false", "-no-color")
    assert "The configuration is valid" in terraform("validate", "-no-color")
    terraform("fmt", "-check", "-recursive", "../..")
