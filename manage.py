#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line
    from django.db.utils import OperationalError

    try:
        execute_from_command_line(sys.argv)
    except OperationalError as exc:
        # DATABASE_URL names a database that does not exist yet: create it (config/database.py)
        # and run the command again; it had done nothing, its first connection failed.
        from config.database import create_if_missing

        if not create_if_missing(exc):
            raise
        execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
