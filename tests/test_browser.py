"""The lessons' widgets in a real headless Chromium: in JupyterLab and as a Voila page.

The JupyterLab tests share one server on a free port with its own runtime and config folders,
and one notebook holding every widget they drive, a cell each, opened and run once (a page and
a kernel each cost seconds to start); each test drives its own widget and reads the kernel.
The server is stopped (its kernels too) after the last. The Voila test starts its own.
Debian's Chromium drives it through Playwright; nothing is downloaded and nothing needs the
network. On a failure a screenshot is saved in the test's tmp_path; a passing test leaves one
of its widget there too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mplab.numerics import formats

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
WAIT_S = 90  # the longest any single wait may take
FLIP = ("fp16", 14)  # the bit the tests click: fp16's top exponent bit
LAB_ROOTS: dict[str, Path] = {}  # a running JupyterLab's base url -> the folder it serves

if not Path(CHROMIUM).exists():
    pytest.skip(f"browser tests need Debian's Chromium at {CHROMIUM}", allow_module_level=True)
sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(tmp: Path) -> dict:
    """Environment for a server whose runtime, config, data (notebook signatures) and IPython
    files stay under tmp; installed kernels and extensions are still found in sys.prefix."""
    env = dict(os.environ)
    for var, name in (("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_CONFIG_DIR", "config"),
                      ("JUPYTER_DATA_DIR", "data"), ("IPYTHONDIR", "ipython")):
        env[var] = str(tmp / name)
        (tmp / name).mkdir(parents=True, exist_ok=True)
    env["PYTHONUNBUFFERED"] = "1"
    # no news or update checks (there is no network), no windowing: every cell is in the DOM
    settings = tmp / "config" / "lab" / "user-settings" / "@jupyterlab"
    for ext, name, value in (("apputils-extension", "notification",
                              {"fetchNews": "false", "checkForUpdates": False}),
                             ("notebook-extension", "tracker", {"windowingMode": "none"})):
        (settings / ext).mkdir(parents=True, exist_ok=True)
        (settings / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
    return env


def wait_until(check, what: str, timeout: float = WAIT_S, every: float = 0.25):
    """Poll check() until it returns something truthy; fail naming `what` after timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@contextlib.contextmanager
def running(cmd: list[str], *, env: dict, cwd: Path, log: Path, port: int, ready_url: str | None):
    """Run a server until the block ends, then stop it and every process it started."""
    import psutil

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = psutil.Process(proc.pid)
    children: dict[int, psutil.Process] = {}

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2]} exited with {proc.returncode}:\n"
                               + log.read_text(errors="replace")[-3000:])
        try:
            if ready_url is None:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(up, f"{cmd[2]} to answer on port {port}")
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):  # its kernels, though in sessions of their own
            children.update({c.pid: c for c in server.children(recursive=True)})
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a Jupyter server shuts its kernels down on TERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for child in children.values():
            with contextlib.suppress(psutil.Error):
                child.kill()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@contextlib.contextmanager
def new_page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(WAIT_S * 1000)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def page(browser):
    with new_page(browser) as page:
        yield page


@contextlib.contextmanager
def screenshot_on_failure(page, path: Path):
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(path), full_page=True)
            print(f"screenshot of the failure: {path}")
        raise


def flipped(value: float) -> float:
    """What the explorer's value becomes when the test's bit is clicked."""
    fmt, bit = FLIP
    return formats.from_bits(formats.to_bits(value, fmt) ^ (1 << bit), fmt)


def bit_button(page):
    fmt, bit = FLIP
    return page.locator(f".mplab-bit-{fmt}-{bit}")


# --- JupyterLab ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab serving a temporary copy of notebooks/; yields (base url, token, runtime dir).
    One server for the module: starting one costs seconds, a notebook's kernel is per test."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    env = isolated_env(tmp)
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", f"--IdentityProvider.token={token}", "--allow-root",
           f"--ServerApp.root_dir={root}"]
    LAB_ROOTS[base] = root
    with running(cmd, env=env, cwd=root, log=tmp / "lab.log", port=port,
                 ready_url=f"{base}/api/status?token={token}"):
        yield base, token, Path(env["JUPYTER_RUNTIME_DIR"])


def shut_down_kernels(lab) -> None:
    """Ask the server to shut down every kernel it runs."""
    base, token, _ = lab
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.load(r)
    for session in sessions:
        request = urllib.request.Request(f"{base}/api/sessions/{session['id']}?token={token}",
                                         method="DELETE")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=30).close()


def kernel_of(base: str, token: str, notebook: str) -> str:
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.load(r)
    return next((s["kernel"]["id"] for s in sessions if s["path"].endswith(notebook)), None)


@contextlib.contextmanager
def kernel_client(kernel_id: str, runtime_dir: Path):
    """A second client of the notebook's own kernel, through its connection file."""
    from jupyter_client import BlockingKernelClient, find_connection_file

    client = BlockingKernelClient(connection_file=find_connection_file(
        f"kernel-{kernel_id}.json", path=[str(runtime_dir)]))
    client.load_connection_file()
    client.start_channels()
    try:
        # Not wait_for_ready: it calls a kernel dead when its heartbeat has not answered within
        # a second, which a kernel still running cells on a loaded machine often has not.
        client.kernel_info(reply=True, timeout=WAIT_S)
        yield client
    finally:
        client.stop_channels()


def kernel_value(client, expression: str) -> str:
    """repr(expression) as the kernel computes it. The request queues behind any cells the
    notebook is still running, so an answer also means the kernel has finished those."""
    out = []

    def keep(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = client.execute_interactive(f"print(repr({expression}))", timeout=WAIT_S,
                                       output_hook=keep)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out).strip()


def open_and_run(page, lab, notebook: str, sources: list[str]) -> None:
    """Write a notebook of one code cell per source, open it in JupyterLab and run all its
    cells."""
    import nbformat

    base, token, _ = lab
    nbformat.write(nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in sources],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}}), LAB_ROOTS[base] / notebook)
    page.goto(f"{base}/lab/tree/{notebook}?reset&token={token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    wait_until(lambda: kernel_of(base, token, notebook), "the notebook's kernel")
    page.locator(".lm-MenuBar-itemLabel").filter(has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel").filter(has_text=re.compile(r"^Run All Cells$")).click()


#: The widgets the JupyterLab tests drive, a cell each of one notebook, made as the lessons'
#: cells make them (smaller where a lesson's run would only add time).
WIDGET_CELLS = [
    # lesson 1's precision explorer
    "from mplab.widgets.lesson1 import precision_explorer\n"
    "explorer = precision_explorer(0.1)\nexplorer",
    # lesson 2's loss-scale explorer, over a step of the lesson model as initialised (the
    # lesson's trains it first, which the slider does not need)
    "from mplab import fixtures\nfrom mplab.widgets.lesson2 import loss_scale_explorer\n"
    "cap = fixtures.lesson_capture(steps=0)\nscale_explorer = loss_scale_explorer(cap)\n"
    "scale_explorer",
    # lesson 3's GradScaler stepper (the lesson's fp16 run would only add minutes)
    "from mplab.widgets.lesson3 import scaler_stepper\n"
    "stepper = scaler_stepper(growth_interval=2)\nstepper",
    # lessons 4 to 6's training panel
    "from mplab.widgets.training import training_panel\n"
    "panel = training_panel(steps=3, precision='fp32', device='cpu', batch_size=8, "
    "eval_samples=16)\npanel",
    # lesson 7's failure lab
    "from mplab.widgets.lesson7 import failure_lab\n"
    "lab_panel = failure_lab('no_scaler', steps=10)\nlab_panel",
    # lesson 9's recipe explorer, over a layer of the lesson model as initialised
    "from mplab import fixtures, lowbit\nfrom mplab.widgets.lesson9 import recipe_explorer\n"
    "recipes = recipe_explorer(lowbit.layer_tensors(fixtures.lesson_capture(steps=0), "
    "'bert.encoder.layer.0.intermediate.dense'), recipe='MXFP4')\nrecipes",
]


@pytest.fixture(scope="module")
def workbook(lab_server, browser):
    """(page, kernel client): one notebook of every widget the JupyterLab tests drive, opened
    and run once in one page and one kernel, each of which costs seconds to start. Each test
    drives its own widget, and asks the kernel (its requests queue behind the cells still
    running, so an answer also means those have finished)."""
    base, token, runtime_dir = lab_server
    notebook = "widgets.ipynb"
    with new_page(browser) as page:
        try:
            open_and_run(page, lab_server, notebook, WIDGET_CELLS)
            with kernel_client(kernel_of(base, token, notebook), runtime_dir) as client:
                yield page, client
        finally:
            shut_down_kernels(lab_server)


def test_clicking_a_bit_in_jupyterlab_changes_the_kernels_value(workbook, tmp_path):
    """Lesson 1's explorer: a click on a bit changes the value the kernel holds."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        button = bit_button(page)
        button.wait_for(state="visible")
        before = float(kernel_value(client, "explorer.value"))
        expected = flipped(before)
        assert expected != before
        button.scroll_into_view_if_needed()
        button.click()
        fmt = FLIP[0]
        page.locator(f".mplab-value-{fmt}").filter(has_text=f"= {expected!r}").wait_for()
        assert float(kernel_value(client, "explorer.value")) == expected
        assert kernel_value(client, f"explorer.rows[{fmt!r}].bits") == repr(
            formats.to_bits(expected, fmt))
        page.locator(".mplab-explorer").screenshot(path=str(tmp_path / "explorer-lab.png"))


# --- Voila -----------------------------------------------------------------------------------

@pytest.fixture
def voila(tmp_path):
    """`voila notebooks/precision_explorer.ipynb` on a free port; yields its base url."""
    env = isolated_env(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "voila", "notebooks/precision_explorer.ipynb", "--no-browser",
           f"--port={port}", "--Voila.ip=127.0.0.1", f"--Voila.connection_dir_root={tmp_path}"]
    # readiness by TCP: a GET of the page would itself start a kernel and run the notebook
    with running(cmd, env=env, cwd=ROOT, log=tmp_path / "voila.log", port=port, ready_url=None):
        yield f"http://127.0.0.1:{port}"


def test_clicking_a_bit_on_the_voila_page_shows_the_new_value(voila, page, tmp_path):
    fmt = FLIP[0]
    expected = flipped(0.1)  # the page's explorer starts at 0.1
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        page.goto(voila + "/", timeout=WAIT_S * 1000)
        button = bit_button(page)
        button.wait_for(state="visible")
        value = page.locator(f".mplab-value-{fmt}")
        assert f"= {formats.round_to(0.1, fmt)!r}" in value.inner_text()
        button.click()
        value.filter(has_text=f"= {expected!r}").wait_for()
        page.locator(".mplab-current").filter(has_text=repr(expected)).wait_for()
        page.locator(".mplab-explorer").screenshot(path=str(tmp_path / "explorer-voila.png"))


@pytest.mark.timeout(600)
def test_moving_the_loss_scale_slider_in_jupyterlab_redraws_the_table(workbook, tmp_path):
    """Lesson 2's loss-scale explorer: three steps of the slider by keyboard, and the table the
    page shows is the one the kernel computed for 2^3."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        explorer = page.locator(".mplab-loss-scale")
        summary = explorer.locator(".mplab-scale-summary")
        summary.filter(has_text="At scale 2^0 ").wait_for(timeout=4 * WAIT_S * 1000)
        table = explorer.locator(".mplab-scale-table")
        before = table.inner_text()
        assert kernel_value(client, "scale_explorer.log2_scale") == "0"
        handle = explorer.locator(".mplab-scale-slider .noUi-handle")
        handle.scroll_into_view_if_needed()
        handle.focus()
        for _ in range(3):  # the keyboard moves the slider a step at a time
            page.keyboard.press("ArrowRight")
        summary.filter(has_text="At scale 2^3 ").wait_for()
        assert kernel_value(client, "scale_explorer.log2_scale") == "3"
        wait_until(lambda: table.inner_text() != before, "the table to change")
        shown = kernel_value(client,
                             "__import__('re').sub('<.*?>', '', scale_explorer.summary.value)")
        assert " ".join(summary.inner_text().split()) == " ".join(eval(shown).split())
        explorer.screenshot(path=str(tmp_path / "loss-scale-lab.png"))


def test_stepping_the_gradscaler_in_jupyterlab(workbook, tmp_path):
    """Lesson 3's stepper: click "next step" and "inject inf", and read the scaler in the
    kernel."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        stepper = page.locator(".mplab-scaler-stepper")
        status = stepper.locator(".mplab-scaler-status")
        status.filter(has_text="After 0 iterations").wait_for()
        for name in ("next-step", "next-step", "inject-inf"):
            stepper.locator(f".mplab-scaler-{name}").click()
        # 2 clean steps grow 2^16 to 2^17; the inf backs it off to 2^16 and skips the step
        status.filter(has_text="After 3 iterations: scale 65536").wait_for()
        assert "1 step skipped" in status.inner_text()
        assert "✓ torch.amp.GradScaler" in stepper.locator(".mplab-scaler-agreement").inner_text()
        rows = stepper.locator(".mplab-scaler-table tr")
        assert "skipped" in rows.nth(3).inner_text()
        assert kernel_value(client, "[r.found_inf for r in stepper.scaler.history]") == \
            "[False, False, True]"
        assert kernel_value(client, "stepper.scaler.get_scale()") == "65536.0"
        stepper.screenshot(path=str(tmp_path / "stepper-lab.png"))


def test_training_on_each_path_from_the_panel_in_jupyterlab(workbook, tmp_path):
    """Lessons 4 to 6's panel, one path after another in the same panel: a short fp32 run on
    the torch path (lesson 4); fp16 on the Accelerate path (lesson 5), whose row shows float32
    matmuls and whose message says Accelerate ignored fp16; fp16 through the Trainer (lesson
    6), the same. Each row is the run the kernel holds, with its audit."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        panel = page.locator(".mplab-training-panel")
        table = panel.locator(".mplab-train-table")
        message = panel.locator(".mplab-train-message")
        table.filter(has_text="No runs yet").wait_for()
        assert panel.locator(".mplab-train-path .mod-active").inner_text() == "torch"

        def pick(group: str, name: str) -> None:
            panel.locator(f".mplab-train-{group} button").filter(
                has_text=re.compile(f"^{name}$")).click()
            panel.locator(f".mplab-train-{group} .mod-active").filter(has_text=name).wait_for()

        def train(run: int) -> list[str]:
            panel.locator(".mplab-train-button").click()
            row = table.locator("tr").nth(run)
            row.wait_for()
            return row.locator("td").all_inner_texts()

        cells = train(1)  # lesson 4: the torch path, fp32
        assert cells[:6] == ["1", "torch", "fp32", cells[3], "float32", "3"]
        final = float(kernel_value(client, "panel.results[0].final_loss"))
        assert cells[6] == f"{final:.4f}"
        pick("path", "accelerate")  # lesson 5: fp16 on a CPU, ignored by Accelerate
        pick("precision", "fp16")
        cells = train(2)
        assert cells[:6] == ["2", "accelerate", "fp16", cells[3], "float32", "3"]
        message.filter(has_text="Accelerate ignores fp16 on a CPU").wait_for()
        assert kernel_value(client, "panel.results[1].audit.mixed") == "False"
        assert kernel_value(client, "panel.results[1].audit.fallbacks[0].code") == \
            "'fp16_ignored'"
        pick("path", "trainer")  # lesson 6: the Trainer hands fp16 to Accelerate
        wait_until(lambda: kernel_value(client, "panel.path.value") == "'trainer'",
                   "the kernel to see the trainer path picked")
        cells = train(3)
        assert cells[:6] == ["3", "trainer", "fp16", cells[3], "float32", "3"]
        message.filter(has_text="the Trainer (through Accelerate) ignores fp16").wait_for()
        assert kernel_value(client, "[r.path for r in panel.results]") == \
            "['torch', 'accelerate', 'trainer']"
        assert kernel_value(client, "str(panel.results[2].compute_dtype)") == \
            "'torch.float32'"
        final = float(kernel_value(client, "panel.results[2].final_loss"))
        assert cells[6] == f"{final:.4f}"
        panel.screenshot(path=str(tmp_path / "panel-lab.png"))


def test_running_a_failure_and_its_fix_in_the_failure_lab_in_jupyterlab(workbook, tmp_path):
    """Lesson 7's failure lab: press "run it" for fp16 without a GradScaler, read diagnose
    naming it on the page, press "apply the fix and run again", and read the verdict "fixed",
    the same verdict the kernel computed from the fixed run's diagnosis."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "failure.png"):
        panel = page.locator(".mplab-failure-lab")
        broken = panel.locator(".mplab-lab-diagnosis-broken")
        broken.filter(has_text="press “run it”").wait_for()
        panel.locator(".mplab-lab-run-button").click()
        broken.filter(has_text="[broken] fp16 without a GradScaler").wait_for()
        verdict = panel.locator(".mplab-lab-verdict")
        assert verdict.inner_text() == ""
        panel.locator(".mplab-lab-fix-button").click()
        verdict.filter(has_text="fixed: diagnose no longer finds fp16 without a GradScaler") \
            .wait_for()
        assert kernel_value(client, "'no_scaler' in lab_panel.diagnoses['broken']") == "True"
        assert kernel_value(client, "'no_scaler' in lab_panel.diagnoses['fixed']") == "False"
        assert kernel_value(client, "[r['fix'] for r in lab_panel.rows]") == \
            "['none (broken)', 'scaler']"
        said = kernel_value(client, "__import__('re').sub('<.*?>', '', lab_panel.verdict.value)")
        assert verdict.inner_text() == eval(said)
        assert panel.locator(".mplab-lab-run-button").is_enabled()
        panel.screenshot(path=str(tmp_path / "failure-lab-lab.png"))



def test_picking_a_recipe_and_a_block_in_the_recipe_explorer_in_jupyterlab(workbook, tmp_path):
    """Lesson 9's explorer: pick NVFP4 in the recipe menu, read its figures on the page (the
    same the kernel's widget holds), then MXFP8 with blocks of 8."""
    page, client = workbook
    with screenshot_on_failure(page, tmp_path / "recipes.png"):
        panel = page.locator(".mplab-recipes")
        view = panel.locator(".mplab-recipes-view")
        view.filter(has_text="MXFP4, block 32").wait_for()
        panel.locator(".mplab-recipes-recipe select").select_option("NVFP4")
        view.filter(has_text="NVFP4").wait_for()
        sqnr = kernel_value(client, "recipes.rows.rows[0]['SQNR (dB)']")
        assert kernel_value(client, "recipes.rows.title") == "'NVFP4'"
        assert sqnr in view.inner_text()
        panel.locator(".mplab-recipes-recipe select").select_option("MXFP8")
        view.filter(has_text="MXFP8, block 32").wait_for()
        panel.locator(".mplab-recipes-block select").select_option("8")
        view.filter(has_text="MXFP8, block 8").wait_for()
        assert kernel_value(client, "recipes.quantized.block") == "(1, 8)"
        assert kernel_value(client, "recipes.message.value") == "''"
