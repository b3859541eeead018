"""The project's settings with one extra URL that fails (tests/test_error_pages.py): a 500
under the served stack, to see what the log, the header and the page say."""

from config.settings import *  # noqa: F403

ROOT_URLCONF = "tests.support.error_urls"
