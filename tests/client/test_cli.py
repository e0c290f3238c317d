from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from maec_client import Client
from maec_client.cli import main
from maec_client.options import DOWNLOAD_FLAGS, DownloadOptions
from tests.client.conftest import EXACT
from tests.client.test_client import MERGEKIT_YAML
from tests.client.test_download import FILES


@pytest.fixture
def run(fake, clock, monkeypatch, tmp_path):
    # No ambient configuration may leak in from the machine running the tests.
    for name in ("MAEC_URL", "MAEC_API_KEY", "MAEC_CONFIG", "MAEC_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))

    def factory(config):
        return Client(config=config, transport=fake.transport(), retry=EXACT,
                      sleep=clock.sleep, clock=clock)

    def invoke(*args, input=None, env=None):
        runner = CliRunner()
        return runner.invoke(main, ["jobs", *args], obj={"client_factory": factory},
                             input=input, env=env, catch_exceptions=False)

    return invoke


def test_submit_json_round_trip_and_status(run, fake, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MERGEKIT_YAML)
    res = run("submit", str(recipe), "--json", "--api-key", "k1")
    assert res.exit_code == 0, res.output
    job = json.loads(res.stdout)
    assert job["status"] == "queued" and job["recipe"]["merge_method"] == "ties"
    res = run("--json", "--api-key", "k1", "status", job["id"])
    assert res.exit_code == 0 and json.loads(res.stdout)["id"] == job["id"]
    res = run("status", job["id"], "--api-key", "k1")
    assert "status:    queued" in res.stdout and "method:    ties" in res.stdout


def test_submit_from_stdin_prints_id(run, fake):
    res = run("submit", "-", "--api-key", "k1", "--name", "sw", input=MERGEKIT_YAML)
    assert res.exit_code == 0 and res.stdout.strip() == "j_0001"
    assert fake.jobs["j_0001"]["name"] == "sw"


def test_url_and_key_from_env_and_config_file(run, fake, tmp_path):
    cfg = tmp_path / "xdg" / "maec"
    cfg.mkdir(parents=True)
    (cfg / "client.toml").write_text('url = "http://127.0.0.1:7001"\napi_key = "k1"\n')
    fake.add_job()
    assert run("status", "j_0001").exit_code == 0
    assert str(fake.requests[-1].url).startswith("http://127.0.0.1:7001/")
    res = run("status", "j_0001", env={"MAEC_URL": "http://127.0.0.1:7002",
                                       "MAEC_API_KEY": "bad"})
    assert res.exit_code == 3
    assert str(fake.requests[-1].url).startswith("http://127.0.0.1:7002/")
    (cfg / "client.toml").unlink()
    res = run("status", "j_0001")
    assert res.exit_code == 3 and "no API key configured" in res.stderr
    res = run("status", "j_0001", "--url", "http://127.0.0.1:7003", "--api-key", "k1",
              env={"MAEC_URL": "http://127.0.0.1:7002", "MAEC_API_KEY": "bad"})
    assert res.exit_code == 0
    assert str(fake.requests[-1].url).startswith("http://127.0.0.1:7003/")


@pytest.mark.parametrize(("args", "code", "err_code"), [
    (["status", "j_9999"], 4, "job_not_found"),
    (["status", "j_0001", "--api-key", "wrong"], 3, "unauthorized"),
    (["cancel", "j_0002"], 8, "job_finished"),
    (["download", "j_0001", "OUT"], 2, "job_not_succeeded"),
    (["watch", "j_0003"], 1, "time_limit"),
    (["watch", "j_0004"], 7, "cancelled"),
    (["watch", "j_0001", "--timeout", "3"], 7, "wait_timeout"),
])
def test_exit_codes_and_json_errors(run, fake, tmp_path, args, code, err_code):
    fake.add_job(status="running")
    fake.add_job(status="succeeded")
    fake.add_job(status="failed", error={"code": "time_limit", "message": "too slow",
                                         "details": {}})
    fake.add_job(status="cancelled")
    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    if "--api-key" not in args:
        args += ["--api-key", "k1"]
    res = run(*args, "--json")
    assert res.exit_code == code, res.output
    err = json.loads(res.stdout)["error"]
    assert err["code"] == err_code and err["exit_code"] == code
    res = run(*args)
    assert res.exit_code == code and f"[{err_code}]" in res.stderr


def test_invalid_recipe_and_missing_file_exit_2(run, fake, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("merge_method: ties\nmodels: [{model: s3://a}]\n")
    res = run("submit", str(bad), "--api-key", "k1")
    assert res.exit_code == 2 and "needs base_model" in res.stderr
    res = run("submit", str(tmp_path / "nope.yaml"), "--api-key", "k1")
    assert res.exit_code == 2
    res = run("list", "--limit", "0")
    assert res.exit_code == 2  # click's own usage errors share the code
    assert fake.requests == []


def test_network_failure_exit_5(run, fake):
    fake.fail_next = [0] * 10
    res = run("status", "j_0001", "--api-key", "k1")
    assert res.exit_code == 5 and "network_error" in res.stderr


def test_list_all_pages_and_table(run, fake):
    for _ in range(25):
        fake.add_job()
    res = run("list", "--json", "--all", "--api-key", "k1")
    assert len(json.loads(res.stdout)["jobs"]) == 25
    res = run("list", "--limit", "3", "--api-key", "k1")
    lines = res.stdout.splitlines()
    assert lines[0].startswith("ID") and len(lines) == 4 and lines[1].startswith("j_0025")


def test_cancel_and_watch_success(run, fake):
    fake.add_job()
    res = run("cancel", "j_0001", "--api-key", "k1")
    assert res.exit_code == 0 and "cancelled" in res.stdout
    job = fake.add_job(status="running")
    fake.script[job["id"]] = [{"progress": {"fraction": 0.5, "done": 1, "total": 2}},
                              {"status": "succeeded"}]
    res = run("watch", job["id"], "--api-key", "k1", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["status"] == "succeeded"


def test_download_json_and_checksum_exit_6(run, fake, tmp_path):
    job = fake.add_job()
    fake.finish(job["id"], FILES)
    dest = tmp_path / "out"
    res = run("download", job["id"], str(dest), "--json", "--api-key", "k1",
              "--part-size", "30KB")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["dir"] == str(dest) and len(out["files"]) == len(FILES)
    assert {p.name for p in dest.rglob("*") if p.is_file()} == {p.split("/")[-1]
                                                                for p in FILES}
    res = run("download", job["id"], str(dest), "--api-key", "k1")
    assert res.exit_code == 2 and "exists" in res.stderr
    fake.corrupt.add((job["id"], "config.json", 3))
    res = run("download", job["id"], str(tmp_path / "bad"), "--api-key", "k1")
    assert res.exit_code == 6 and not (tmp_path / "bad").exists()
    res = run("download", job["id"], str(tmp_path / "x"), "--part-size", "lots")
    assert res.exit_code == 2


def test_download_flags_are_generated_from_the_download_options(run, fake, tmp_path):
    # Every flagged DownloadOptions field is a flag of `maec jobs download`, and what the
    # flags say reaches the downloader as one DownloadOptions.
    help_text = run("download", "--help").stdout
    for name in DOWNLOAD_FLAGS:
        assert f"--{name.replace('_', '-')}" in help_text, name
    assert "[default: 64MiB]" in help_text and "1<=x<=64" in help_text
    seen: list[DownloadOptions] = []
    real = Client.download

    def spy(self, job, dest, options=None, **fields):
        seen.append(DownloadOptions.of(options, **fields))
        return real(self, job, dest, options, **fields)

    job = fake.add_job()
    fake.finish(job["id"], FILES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Client, "download", spy)
        res = run("download", job["id"], str(tmp_path / "o"), "--workers", "3",
                  "--part-size", "30KB", "--redirect", "--no-progress", "--api-key", "k1")
    assert res.exit_code == 0, res.output
    assert seen == [DownloadOptions(workers=3, part_size=30_000, redirect=True)]
    with pytest.raises(TypeError):
        DownloadOptions.of(worker=3)  # a misspelt option fails as a keyword would
    with pytest.raises(ValueError):
        DownloadOptions(workers=0)


def test_merge_command_still_present_and_cli_is_torch_free():
    res = CliRunner().invoke(main, ["merge", "--help"])
    assert res.exit_code == 0 and "RECIPE" in res.stdout
    code = ("import sys; from maec_client.cli import main;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_script_start_imports_no_http_stack():
    # `maec merge` goes through this script: the HTTP client, its settings and the
    # contract models are for `maec jobs` only and load when a jobs command runs.
    code = ("import sys; from maec_client.cli import main;"
            "import maec_client;"
            "heavy = sorted(m for m in ('httpx', 'pydantic_settings', 'maec_contract',"
            " 'maec_client.client', 'maec_client.models') if m in sys.modules);"
            "assert not heavy, heavy;"
            "assert maec_client.Client.__module__ == 'maec_client.client';"
            "assert 'httpx' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_delete_pin_and_unpin(run, fake):
    queued = fake.add_job()
    done = fake.add_job("succeeded")
    res = run("delete", queued["id"], "--api-key", "k1")
    assert res.exit_code == 8 and "job_active" in res.output
    res = run("pin", done["id"], "--api-key", "k1")
    assert res.exit_code == 0 and res.stdout.strip() == f"{done['id']}: pinned"
    res = run("--json", "unpin", done["id"], "--api-key", "k1")
    assert res.exit_code == 0 and json.loads(res.stdout)["pinned"] is False
    res = run("delete", done["id"], "--api-key", "k1")
    assert res.exit_code == 0 and res.stdout.strip() == f"{done['id']}: deleted"
    assert done["id"] not in fake.jobs
    res = run("delete", done["id"], "--api-key", "k1")
    assert res.exit_code == 4 and "job_not_found" in res.output
    res = run("--json", "delete", done["id"], "--missing-ok", "--api-key", "k1")
    assert res.exit_code == 0 and json.loads(res.stdout) == {"job_id": done["id"],
                                                           "deleted": True}


def test_submit_pin_flag_sends_pinned(run, fake, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MERGEKIT_YAML)
    assert run("submit", str(recipe), "--pin", "--api-key", "k1").exit_code == 0
    assert json.loads(fake.requests[-1].content)["pinned"] is True
    assert run("submit", str(recipe), "--api-key", "k1").exit_code == 0
    assert "pinned" not in json.loads(fake.requests[-1].content)


def test_submit_gguf_flag_asks_for_a_gguf_output(run, fake, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MERGEKIT_YAML)
    assert run("submit", str(recipe), "--gguf", "q8_0", "--api-key", "k1").exit_code == 0
    body = json.loads(fake.requests[-1].content)
    assert body["output"] == {"gguf": "q8_0"} and "output" not in body["recipe"]
    # A recipe with an output of its own gets the type there (one output, not two).
    recipe.write_text(MERGEKIT_YAML + "output:\n  format: model\n")
    assert run("submit", str(recipe), "--gguf", "f16", "--api-key", "k1").exit_code == 0
    body = json.loads(fake.requests[-1].content)
    assert body["recipe"]["output"] == {"format": "model", "gguf": "f16"}
    assert "output" not in body


def _script(body: str) -> subprocess.CompletedProcess[str]:
    """``body`` run as the ``maec`` script is: ``main()`` reading ``sys.argv``."""
    code = ("import atexit, sys, threading, time\n"
            "from maec_client.cli import main\n"
            "class Teardown:\n"
            "    def __del__(self):\n"
            "        sys.stderr.write('teardown ran\\n')\n"
            "keep = Teardown()\n"
            "atexit.register(lambda: sys.stdout.write('atexit ran\\n'))\n"
            f"{body}\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_script_ends_without_the_interpreter_teardown_keeping_status_and_output():
    done = _script("sys.argv = ['maec', 'jobs', '--help']")
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and done.stdout.endswith("atexit ran\n")
    assert "teardown ran" not in done.stderr
    usage = _script("sys.argv = ['maec', 'jobs', '--no-such-flag']")
    assert usage.returncode == 2 and "No such option" in usage.stderr
    assert usage.stdout == "atexit ran\n" and "teardown ran" not in usage.stderr


def test_the_script_exits_normally_while_a_thread_of_the_command_still_runs():
    done = _script(
        "@main.command()\n"
        "def probe():\n"
        "    def late():\n"
        "        time.sleep(0.3)\n"
        "        print('thread finished')\n"
        "    threading.Thread(target=late).start()\n"
        "sys.argv = ['maec', 'probe']")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "thread finished\natexit ran\n"
    assert "teardown ran" in done.stderr


def test_a_command_s_library_loads_with_the_collector_off_and_is_left_out_after():
    import gc

    import click

    from maec_client.cli import _load

    seen = []

    class Point:
        def load(self):
            seen.append(gc.isenabled())
            return click.Command("probe")

    frozen = gc.get_freeze_count()
    try:
        kept = [[i] for i in range(1000)]
        assert isinstance(_load(Point()), click.Command)
        assert seen == [False] and gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
        gc.disable()
        _load(Point())
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
