"""docs/swift.md's SwiftUI listing is the example target's ChatViewModel.swift (compiled by
`swift build` in apps/swift), abridged: every line of the listing is in the file, in order."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_swiftui_listing_is_the_compiled_file():
    doc = (ROOT / "docs" / "swift.md").read_text()
    section = doc.split("## SwiftUI", 1)[1].split("\n## ", 1)[0]
    (listing,) = re.findall(r"```swift\n(.*?)```", section, re.S)
    source = (ROOT / "apps" / "swift" / "Sources" / "EdgespecExample" / "ChatViewModel.swift").read_text()
    lines = [ln.strip() for ln in source.splitlines()]
    at = 0
    for want in (ln.strip() for ln in listing.splitlines()):
        if not want or want.startswith("//") or want.startswith("///"):
            continue
        # one-line forms in the listing of what the file spreads over a few lines
        if want.endswith("}") and "{" in want and want not in lines[at:]:
            head = want.split("{", 1)[0].strip()
            assert any(ln.startswith(head) for ln in lines[at:]), f"not in ChatViewModel.swift: {want!r}"
            at = next(i for i in range(at, len(lines)) if lines[i].startswith(head)) + 1
            continue
        assert want in lines[at:], f"not in ChatViewModel.swift (in this order): {want!r}"
        at = lines.index(want, at) + 1


def test_swift_tests_write_in_a_home_of_their_own():
    """`make swift-test` starts real servers: what they persist (learnt costs, checksums) goes to
    a home under the fixture folder, emptied first, never the user's ~/.cache/edgespec."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        import pytest

        pytest.skip("no make")
    # SWIFT=swift: the recipe as it runs where a toolchain is found (-n: printed, not run)
    out = subprocess.run(["make", "-n", "--no-print-directory", "swift-test", "SWIFT=swift"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    home = str(ROOT / ".cache" / "swift-test" / "home")
    runs = [ln for ln in out.splitlines() if "swift_fixture.py" in ln or "EDGESPEC_TEST_PYTHON=" in ln]
    assert len(runs) == 2, out
    assert all(f"EDGESPEC_HOME={home} " in ln for ln in runs), out
    assert "rm -rf .cache/swift-test/home" in out, out
