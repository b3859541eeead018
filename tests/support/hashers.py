"""A cheap PBKDF2 for tests whose subject is not the hasher (the lockout's counting)."""

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """Django's PBKDF2-SHA256 at 1,000 iterations instead of 1.5 M: the same algorithm and
    encoding, so the real hasher checks what it makes (at the iterations it records) and a
    wrong password still runs a hash, as Django does. The lockout tests make about 200 login
    attempts; at the real cost that is over a minute of hashing."""

    iterations = 1000
