"""Settings that carry a secret, given wrongly: every process the service starts refuses
to start, names the variable, and never prints the value (secrets_echoed on the RESULT line).

Each case starts a real entry point (the API as uvicorn runs it, the local launcher, the
worker's settings check) with a bad environment and searches all it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.settings import hash_key
from tests.reliability import results
from tests.stack import free_port

# As on a shared machine: another `make run` may hold the API's default port.
pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("default_api_port_taken")]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAW_KEY = "raw-api-key-given-where-its-digest-belongs-5d1c"
S3_SECRET = "a-real-s3-secret-next-to-a-weak-access-key-81f0"
HOOK_SECRET = "short-hook-key"  # under the 16-character minimum
GOOD_KEYS = json.dumps({"alice": hash_key("k" * 32)})

# (name, environment, the secret it carries, the variable the error must name)
CASES = [
    ("raw api key", {"MAEC_API_KEYS": json.dumps({"alice": RAW_KEY})}, RAW_KEY,
     "MAEC_API_KEYS"),
    ("weak s3 access key", {"MAEC_API_KEYS": GOOD_KEYS, "MAEC_STORAGE_BACKEND": "s3",
                            "MAEC_S3_ACCESS_KEY": "minioadmin",
                            "MAEC_S3_SECRET_KEY": S3_SECRET}, S3_SECRET,
     "MAEC_S3_ACCESS_KEY"),
    ("short webhook secret", {"MAEC_API_KEYS": GOOD_KEYS,
                              "MAEC_WEBHOOK_SECRETS": json.dumps({"alice": HOOK_SECRET})},
     HOOK_SECRET, "MAEC_WEBHOOK_SECRETS"),
]
# The entry points a deployment or a user starts.
COMMANDS = {
    "api": [str(BIN / "uvicorn"), "app.api.main:create_app", "--factory",
            "--host", "127.0.0.1", "--port", "0"],
    "worker settings": [sys.executable, "-c",
                        "from app.settings import get_settings; get_settings()"],
    "local run": [sys.executable, "-m", "app.run_local"],
}


def _run(cmd: list[str], env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MAEC_")}
    # The local run honours MAEC_DEV_MODE=false: it checks settings before starting
    # anything, so no Redis or port is taken by these cases. Were one accepted, it would
    # find no Redis at the URL below rather than the machine's own.
    full = {**clean, **env, "MAEC_DEV_MODE": "false", "MAEC_WORK_DIR": str(tmp / "work"),
            "MAEC_STORAGE_DIR": str(tmp / "storage"),
            "MAEC_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=180)


# The local run always uses local storage, so S3 settings do not apply to it.
PAIRS = [(command, *case) for command in COMMANDS for case in CASES
         if not (command == "local run" and case[1].get("MAEC_STORAGE_BACKEND") == "s3")]


@pytest.mark.parametrize(("command", "name", "env", "secret", "variable"), PAIRS,
                         ids=[f"{p[0]}-{p[1]}" for p in PAIRS])
def test_a_bad_secret_setting_is_refused_and_never_echoed(
        command: str, name: str, env: dict[str, str], secret: str, variable: str,
        tmp_path: Path) -> None:
    # The local run gets its own folder and a free port, never the default 8000.
    args = (["--var", str(tmp_path / "var"), "--port", str(free_port())]
            if command == "local run" else [])
    out = _run(COMMANDS[command] + args, env, tmp_path)
    text = out.stdout + out.stderr
    echoed = secret in text
    results.add("secret_cases")
    if echoed:
        results.add("secrets_echoed")
    assert out.returncode != 0, f"{command} started with {name}:\n{text[-2000:]}"
    assert variable in text, text[-2000:]
    assert not echoed, f"{command} printed the secret of {name!r}"


# Key ids a careless or hostile configuration could use: ``alice:ci`` beside ``alice``
# once shared Redis keys (idempotency slots) with it.
BAD_KEY_IDS = {"MAEC_API_KEYS": json.dumps({"alice": hash_key("k" * 32),
                                            "alice:ci": hash_key("j" * 32)})}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_key_id_outside_the_alphabet_stops_every_entry_point(command: str,
                                                               tmp_path: Path) -> None:
    args = (["--var", str(tmp_path / "var"), "--port", str(free_port())]
            if command == "local run" else [])
    out = _run(COMMANDS[command] + args, BAD_KEY_IDS, tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0, f"{command} started with key id 'alice:ci':\n{text[-2000:]}"
    assert "MAEC_API_KEYS" in text and "'alice:ci' is not a valid key id" in text, \
        text[-2000:]
    assert hash_key("j" * 32) not in text
