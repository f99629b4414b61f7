"""A screenshot of the search page: serves a saved index with ``densepass serve``, types a query in headless
Chromium (Debian's package, as the page's test uses) and saves the page as a PNG.

    python3 scripts/search_page_screenshot.py outputs/bench/idx-debian-minilm "edit audio files" \
        --output docs/figures/search-page.png
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def main() -> None:
    """Serve the index, load the search page in headless Chromium, search, and save the screenshot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", help="a saved index directory")
    parser.add_argument("query", help="the query typed into the page")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--k", default="5", help="hits shown (a choice of the page's k menu)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    args = parser.parse_args()

    from playwright.sync_api import expect, sync_playwright

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "densepass", "serve", args.index, "--port", str(port)])
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the service did not start (exit code {server.poll()})")
            time.sleep(0.5)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(url + "/")
            page.fill("#query", args.query)
            page.select_option("#k", args.k)
            page.click("#submit")
            expect(page.locator("#status")).to_contain_text("hits in", timeout=60_000)
            page.screenshot(path=args.output, full_page=True)
            browser.close()
        print(f"wrote {args.output}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
