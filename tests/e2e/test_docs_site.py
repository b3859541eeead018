"""The documentation site as a reader's browser shows it, opened from files as `make docs`
leaves it (site/index.html)."""

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("width", [390, 1024, 1280])
def test_no_setting_name_breaks_mid_word_on_the_settings_reference(chromium, site, width):
    page = chromium.new_page(viewport={"width": width, "height": 900})
    try:
        page.goto((site / "reference" / "settings.html").as_uri())
        broken = page.evaluate("""() => [...document.querySelectorAll(
                'article table td:first-child code')].filter(code => {
            const line = parseFloat(getComputedStyle(code).lineHeight) || 20;
            return code.getClientRects().length > 1
                || code.getBoundingClientRect().height > 1.5 * line;
        }).map(code => code.textContent)""")
        names = page.locator("article table td:first-child code").count()
    finally:
        page.close()
    assert names > 20, f"expected the settings table, found {names} names"
    assert broken == [], f"expected every name on one line at {width} px, found {broken}"
