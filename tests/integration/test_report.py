"""``elasticctl report`` for real: a real job's timeline, and its page laid out by a
real headless browser (Debian's Chromium, which `make test` installs).

The browser test measures the page as Chromium laid it out: a copy of the page
gets a script (and loses the page's policy that forbids scripts) that reads every
mark's bounding box (getBBox) into the DOM, and ``--dump-dom`` brings them back.
The marks must lie inside the plot, at their times, in time order; and a fault
whose message carries markup must show it as text, the markup never run.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from agent import report_html
from tests.fakes.job_history import T0, Job, first_round
from tests.integration.procs import REPO, AgentProcess

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")
HOSTILE = ("worker rank 2 (pid 77) exited with 1: <script>window.pwned = true; "
           "document.title = 'pwned'</script><img src=x onerror=\"window.pwned = true\">")

MEASURE = """<script>
const box = e => { const b = e.getBBox(); return {x: b.x, y: b.y, w: b.width, h: b.height}; };
const all = sel => [...document.querySelectorAll(sel)];
const out = {
  plot: box(document.getElementById('plot')),
  rounds: all('g.round').map(g => ({...box(g.querySelector('rect')), t: +g.dataset.time,
                                     n: +g.dataset.round})),
  faults: all('g.fault').map(g => ({...box(g.querySelector('.mark')), t: +g.dataset.time,
                                     title: g.querySelector('title').textContent})),
  checkpoints: all('g.checkpoint').map(g => ({...box(g.querySelector('line')),
                                              t: +g.dataset.time})),
  stragglers: all('g.straggler').map(g => ({...box(g.querySelector('circle')),
                                            t: +g.dataset.time})),
  images: all('img').length, pwned: window.pwned === true, title: document.title,
  cause: [...document.querySelectorAll('table.faults td.cause')].map(td => td.textContent),
};
const pre = document.createElement('pre');
pre.id = 'measured';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def chromium_dom(page: str, tmp_path) -> str:
    """The DOM of ``page`` after Chromium loaded it (and ran its scripts)."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (`make test` does: "
                    "apt-get install chromium)")
    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                              "--dump-dom", path.as_uri()],
                             capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def measured(page: str, tmp_path) -> dict:
    """The boxes MEASURE read from ``page``, without the page's no-script policy."""
    policy = f'<meta http-equiv="Content-Security-Policy" content="{report_html.CSP}">'
    assert policy in page
    dom = chromium_dom(page.replace(policy, "").replace("</body>", MEASURE + "</body>"),
                       tmp_path)
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, f"the measuring script did not run: {dom[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def three_rounds() -> Job:
    """Round 1 crashes (hostile text in its cause) at 30 s, round 2 loses node b at 70 s,
    round 3 runs on: checkpoints every 10 s, a straggler at 50 s."""
    job = first_round(Job())
    for t in range(10, 100, 10):
        job.commit(float(t), "a", 1 if t < 30 else 2 if t < 70 else 3, t)
    job.stop(30.0, "b", 1, HOSTILE)
    job.formed(31.0, 2, ["a", "b"], f"round 1: restart requested by b: {HOSTILE}; closing "
                                    "with 2 nodes").run(33.0, 2, ["a", "b"])
    job.at(50.0, "a", 2, "straggler", "rank 3 (node b) is persistently slower than its peers")
    job.stop(70.0, "a", 2, "worker rank 0 (pid 5) exited with 1 (log: x)")
    job.formed(75.0, 3, ["a"], "round 2: lost b; closing with 1 node").run(76.0, 3, ["a"])
    return job


def test_the_timeline_is_laid_out_by_a_real_browser_at_its_times(tmp_path):
    report = three_rounds().report(now=100.0)
    m = measured(report_html.render(report), tmp_path)

    plot = m["plot"]
    left, right, top, bottom = plot["x"], plot["x"] + plot["w"], plot["y"], plot["y"] + plot["h"]
    assert plot["w"] > 500 and plot["h"] > 100

    # Every mark lies inside the plot.
    def centre(b):
        return b["x"] + b["w"] / 2, b["y"] + b["h"] / 2
    for lane in ("rounds", "faults", "checkpoints", "stragglers"):
        assert m[lane], f"no {lane} drawn"
        for b in m[lane]:
            x, y = centre(b)
            assert left - 0.5 <= x <= right + 0.5 and top <= y <= bottom, (lane, b, plot)
            assert b["h"] > 0 and (b["w"] > 0 or lane == "checkpoints"), (lane, b)  # ticks

    # Rounds are bands in order, each from its forming to the next round's, side by side.
    rounds = m["rounds"]
    assert [r["n"] for r in rounds] == [1, 2, 3]
    for before, after in zip(rounds, rounds[1:]):
        assert before["x"] + before["w"] == pytest.approx(after["x"], abs=1.0)
    assert rounds[-1]["x"] + rounds[-1]["w"] == pytest.approx(right, abs=1.0)  # still running

    # Marks stand where their times put them on the rounds' scale, in time order.
    scale = (rounds[2]["x"] - rounds[0]["x"]) / (rounds[2]["t"] - rounds[0]["t"])
    for lane in ("faults", "checkpoints", "stragglers"):
        xs = [centre(b)[0] for b in m[lane]]
        assert xs == sorted(xs), lane
        for b in m[lane]:
            expected = rounds[0]["x"] + (b["t"] - rounds[0]["t"]) * scale
            assert centre(b)[0] == pytest.approx(expected, abs=1.5), (lane, b)
    assert [b["t"] for b in m["faults"]] == [T0 + 30.0, T0 + 70.0]
    assert len(m["checkpoints"]) == 9

    # The markup in the crash's message is text: shown, never run.
    assert (m["pwned"], m["images"], m["title"]) == (False, 0, "job j: report")
    assert "<script>window.pwned = true;" in m["faults"][0]["title"]
    assert HOSTILE in m["cause"][0]
    assert "node_lost" in m["faults"][1]["title"] and "node b" in m["faults"][1]["title"]


def test_the_page_as_written_runs_nothing_even_a_script_of_its_own(tmp_path):
    # The page's own policy: even a script that escaped the escaping would not run.
    page = report_html.render(three_rounds().report(now=100.0))
    dom = chromium_dom(page.replace("</body>", MEASURE + "</body>"), tmp_path)
    assert 'id="measured"' not in dom
    assert "timeline of job j" in dom  # it loaded, and drew the timeline


# -------------------------------------------------------------- a real job

def ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.ctl", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(180)
def test_report_of_a_real_job_with_a_crashed_worker(etcd_endpoint, job_id, tmp_path):
    progress = tmp_path / "progress.jsonl"
    agent = AgentProcess(etcd_endpoint, job_id, "a", "1", [
        "--steps", "24", "--step-time", "0.05", "--progress-file", str(progress),
        "--crash", "1:12", "--checkpoint-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5"])
    try:
        assert agent.wait_exit(150) == 0, agent.text
    finally:
        agent.stop()
    page = tmp_path / "report.html"

    text = ctl("report", "--etcd", etcd_endpoint, "--job-id", job_id, "--html", str(page))
    as_json = ctl("report", "--json", "--etcd", etcd_endpoint, "--job-id", job_id)

    assert text.returncode == 0, text.stderr
    assert f"job {job_id}: succeeded; 2 rounds, 1 fault" in text.stdout
    assert "worker_exit" in text.stdout and "cause: worker rank 1 (pid" in text.stdout
    assert "exited with 13" in text.stdout and "history: " in text.stdout
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [(r["number"], r["members"], r["world_size"], r["end"]) for r in data["rounds"]] == [
        (1, ["a"], 2, "fault"), (2, ["a"], 2, "succeeded")]
    [fault] = data["faults"]
    assert (fault["kind"], fault["rank"], fault["node"], fault["round"]) == (
        "worker_exit", 1, "a", 1)
    assert fault["recovery"] == "workers_running" and 0 <= fault["lost_s"] < 30
    assert {c["step"] for c in data["checkpoints"] if c["ok"]} >= {4, 9, 14, 19, 23}
    assert data["history"]["complete"] and data["state"] == "succeeded"
    g = data["goodput"]
    assert 0 < g["ratio"] <= 1
    assert g["productive_s"] + g["rework_s"] + g["lost_s"] + g["other_s"] == pytest.approx(
        g["span_s"])
    # The page is written, with the fault on its timeline.
    written = page.read_text(encoding="utf-8")
    assert written.count('class="fault"') == 1 and written.count('class="round"') == 2


def test_report_of_an_unknown_job_says_it_has_no_history(etcd_endpoint, job_id):
    out = ctl("report", "--etcd", etcd_endpoint, "--job-id", job_id)
    assert out.returncode == 0, out.stderr
    assert "not started" in out.stdout and "no events" in out.stdout


def test_report_to_a_file_that_cannot_be_written_is_a_clear_error(etcd_endpoint, job_id):
    out = ctl("report", "--etcd", etcd_endpoint, "--job-id", job_id, "--html",
              "/nonexistent-dir/report.html")
    assert out.returncode == 2
    assert "--html /nonexistent-dir/report.html: cannot write the report there" in out.stderr
