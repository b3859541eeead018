"""`manage.py demo_articles`: the simulated articles service, served until SIGTERM."""

import signal
import threading

from django.core.management.base import BaseCommand, CommandError

from demo.simulated.articles import (
    HOST,
    ArticlesService,
    demo_articles_file,
    demo_articles_port,
    load_articles,
    save_articles,
)


class Command(BaseCommand):
    help = ("Serve the simulated articles service (demo/simulated/articles.py) on 127.0.0.1 "
            "until SIGTERM or Ctrl-C, so that the demo's reconciler has a service to read. "
            "It starts with the articles the demo seed's agents created on it (and those it "
            "had when it last stopped), from DEMO_ARTICLES_FILE, else "
            ".local/demo-articles-<port>.json, and writes them back there when it stops.")

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=None,
                            help=f"port on {HOST} (default: DEMO_ARTICLES_PORT, else the "
                                 "desk's port in LEDGER_DESK_URL + 765: 8765 beside 8000)")

    def handle(self, *args, port, **options):
        if port is None:
            try:
                port = demo_articles_port()
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        if not 0 < port < 65536:
            raise CommandError(f"expected --port between 1 and 65535, found {port}")
        path = demo_articles_file()
        try:
            articles = load_articles(path)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            service = ArticlesService(port=port, articles=articles).start()
        except OSError as exc:
            raise CommandError(f"expected {HOST}:{port} to be free, found {exc}") from exc
        self.stdout.write(f"demo_articles: started with {len(articles)} article(s) from {path}, "
                          f"articles at {service.articles_url}")
        try:
            stop.wait()
        finally:
            service.stop()
            save_articles(path, service.side_effects())
        self.stdout.write(f"demo_articles: stopped; {len(service.side_effects())} article(s) "
                          f"kept in {path}")
