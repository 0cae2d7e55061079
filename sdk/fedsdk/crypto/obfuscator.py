"""Paillier obfuscators: the message-independent, expensive half of encryption, and how to remove them.

With g = n + 1 (Paillier 1999, §4, and phe), ``Enc(m; x) = (1 + n·m)·x mod n²`` for an n-th residue x.
x does not depend on m, so a device makes it ahead of time (the obfuscator pool) and encryption on the
round's critical path is one multiplication. We also use the identity, exact for an n-th residue x::

    (1 + n·m)·x ≡ x + n·((m·(x mod n)) mod n)   (mod n²)

so the online step multiplies two n-sized numbers instead of two n²-sized ones (:func:`raw_encrypt_with`).
Any n-th residue decrypts away (``x^λ ≡ 1 mod n²``), so every ciphertext below decrypts with phe's own
``raw_decrypt`` (the tests check it).

**Short exponents over a fixed base** (the default, ``short=True``). Decision (ours, following the
Damgård–Jurik–Nielsen variant of Paillier): ``x = h^α mod n²`` with ``h = y^n mod n²`` a fixed n-th residue
and α uniform in ``[0, 2^ℓ)``. Because h is fixed, ``h^α`` is a fixed-base exponentiation: with a table of
``h^(d·256^i)`` (:class:`FixedBase`, 8-bit windows) it costs ℓ/8 multiplications and no squaring, about
65-110 µs at |n| = 2048 against 7.6-11.4 ms for phe's ``r^n mod n²`` (one core of a shared VM, by day;
``python benchmarks/he_steps.py``; docs/crypto.md, "Encryption cost and the obfuscator pool").

* *Distribution.* Paillier's semantic security (under DCR) needs x indistinguishable from a uniform n-th
  residue. Damgård, Jurik and Nielsen (“A generalization of Paillier's public-key system with
  applications to electronic voting”, Int. J. Inf. Secur. 9(6), 2010, the optimisation with
  ``h_s = h^{n^s}`` and r of ⌈k/2⌉ bits, s = 1 here; also Damgård–Jurik, PKC 2001) use exactly this form
  with ℓ = |n|/2 and argue it from DCR and the result of Håstad, Schrift and Shamir (“The discrete
  logarithm modulo a composite hides O(n) bits”, JCSS 47(3), 1993): half-length exponents in Z*_n are
  pseudo-random as long as factoring is hard. We go shorter, to ``ℓ = 2κ`` for a modulus of κ-bit strength
  (NIST SP 800-57 Part 1 rev. 5, Table 2: κ = 112 for 2048 bits, 128 for 3072, 192 up to 7680, 256
  above; :func:`exponent_bits`). That rests on the short-exponent assumption (Koshiba and Kurosawa, “Short
  exponent Diffie-Hellman problems”, PKC 2004; Gennaro, “An improved pseudo-random generator based on
  discrete log”, CRYPTO 2000): the best known way to tell ``h^α`` with α < 2^ℓ from a full-length power is
  to find α, and the best known way to find an exponent known to lie in an interval of width 2^ℓ is
  Pollard's kangaroo, 2^(ℓ/2) = 2^κ group operations (van Oorschot and Wiener, “On Diffie-Hellman key
  agreement with short exponents”, EUROCRYPT 1996, and J. Cryptology 12, 1999). Their faster attack on
  short exponents combines Pohlig–Hellman over the small factors of the group order; here that order
  divides λ(n), which an attacker cannot know without factoring n. The same exponent lengths are used in
  practice by Ericsson's OPHELib (Jost, Lam, Maximov and Smeets, “Encryption performance improvements of
  the Paillier cryptosystem”, IACR ePrint 2015/864), whose randomisers carry κ bits of entropy.
  ``short=False`` keeps the classic uniform ``r^n`` (see below) for whoever will not take the assumption.
* *Base.* With the secret primes (key mode ``shared``) h is derived from them with HKDF-SHA256, so every
  key holder of a cluster has the same h and the coordinator never sees it. With the public key only
  (``keyserver``) each factory draws its own y from :mod:`secrets`.
* *Exponents.* Public key only: α from :mod:`secrets`. With the secret primes: ``α = PRF_K(seed, i)``,
  keyed BLAKE2b (RFC 7693, keyed mode) under ``K = HKDF-SHA256(p | q)``, with ``seed`` 16 random bytes
  per factory and process (two of them: one for the pool's worker, one for what the device makes on the
  spot) and ``i`` a counter per seed, so no (seed, i) is ever used twice (the obfuscator's
  :attr:`Obfuscator.tag`). A device sends the tags of its ciphertexts (:func:`pack_coins`, 28 bytes a run of
  consecutive ones). Without K they are random labels: by PRF security, to anyone without the secret key
  the α are indistinguishable from uniform, which is the case above. With K, any key holder recomputes
  the sum A of the exponents inside an aggregate ciphertext, and :meth:`ObfuscatorFactory.open` removes
  ``h^A`` with the same table instead of phe's two |n|/2-bit exponentiations: about 70 µs against 2 ms per
  ciphertext at 2048 bits. The powers depend on A only, so a device that can guess the next aggregate's
  tags makes them ahead (:meth:`ObfuscatorFactory.opening`, ``PackedPaillierBackend.prepare_openings``)
  and opens with a few multiplications when it arrives (:meth:`ObfuscatorFactory.open_with`, about
  12 µs). Whoever holds K can already decrypt, so nothing is given away; the result is checked
  (``C·h^-A ≡ 1 mod n`` must hold, which a wrong A fails except with negligible probability) and a
  ciphertext whose tags are missing, wrong or forged by a coordinator is decrypted the classic way.

**Classic** (``short=False``): public key only, r uniform in [1, n), ``x = r^n mod n²``, phe's own
``raw_encrypt`` exponentiation; with the primes, CRT with Teichmüller lifts: the n-th residues modulo n²
are, by CRT, the product of μ_{p-1} ⊂ Z*_{p²} and μ_{q-1} ⊂ Z*_{q²}; for a uniform in Z*_p, ``a^p mod p²``
is uniform on μ_{p-1} (injective since ``a^p ≡ a mod p``), as is ``r^n mod p²`` for uniform r, so two
|n|/2-bit exponents modulo |n|-bit numbers give exactly the distribution of ``r^n mod n²``.

Every obfuscator must be used exactly once; the pool and the tags guarantee it for the ones made here.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedsdk.crypto._intmath import IntOps
from fedsdk.errors import CiphertextError

__all__ = [
    "COIN_RUN",
    "FixedBase",
    "Obfuscator",
    "ObfuscatorFactory",
    "Opening",
    "Tag",
    "exponent_bits",
    "next_coins",
    "pack_coins",
    "raw_encrypt_with",
    "security_bits",
    "unpack_coins",
]

Tag = tuple[bytes, int]
"""``(seed, index)``: names the PRF exponent of an obfuscator made with the secret primes."""

SEED_BYTES = 16
COIN_RUN = struct.Struct(">16sQI")  # seed, first index, number of consecutive indices
SUM_HEADROOM_BITS = 16  # exponent sums of up to 2**16 obfuscators fit the tables
_BASE_INFO = b"fedsdk obfuscator base v1"
_PRF_INFO = b"fedsdk obfuscator exponents v1"


class Obfuscator(NamedTuple):
    """``x = h^α mod n²`` (or ``r^n``), ``x mod n``, and the tag of α when it can be recomputed."""

    x: Any
    xn: Any
    tag: Tag | None = None


def security_bits(key_bits: int) -> int:
    """Strength κ of a Paillier/RSA modulus (NIST SP 800-57 Part 1 rev. 5, Table 2; a size between two rows
    gets the stronger row, so the exponent is never the weaker link; below 2048 bits, 112 all the same)."""
    for limit, kappa in ((2048, 112), (3072, 128), (7680, 192)):
        if key_bits <= limit:
            return kappa
    return 256


def exponent_bits(key_bits: int) -> int:
    """ℓ = 2κ: Pollard's kangaroo needs 2^(ℓ/2) steps to find an exponent below 2^ℓ (module docstring)."""
    return 2 * security_bits(key_bits)


class FixedBase:
    """``base^e mod m`` for ``0 <= e < 2^(8·rows)`` from a table ``t[i][d] = base^(d·256^i)``.

    One multiplication per non-zero byte of e (the fixed-base windowing of Brickell, Gordon, McCurley and
    Wilson, EUROCRYPT 1992, with 8-bit windows): ``rows·255`` entries of |m| bits, built with as many
    multiplications (about 1.8 MB and 12 ms for |m| = 2048 and 240-bit exponents, with gmpy2).
    """

    __slots__ = ("m", "rows")

    def __init__(self, ops: IntOps, base: Any, m: Any, bits: int) -> None:
        self.m = m
        rows: list[list[Any]] = []
        step = ops.big(base) % m
        for _ in range(-(-int(bits) // 8)):
            row = [ops.big(1), step]
            for _ in range(254):
                row.append(row[-1] * step % m)
            rows.append(row)
            step = row[-1] * step % m  # base^(256^(i+1))
        self.rows = rows

    def pow(self, e: int) -> Any:
        """``base^e mod m``; ``OverflowError`` for an exponent beyond the table (a bug, never input)."""
        m, rows = self.m, self.rows
        acc = None
        for row, d in zip(rows, int(e).to_bytes(len(rows), "little"), strict=True):
            if d:
                acc = row[d] if acc is None else acc * row[d] % m
        return rows[0][0] if acc is None else acc


def _hkdf(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


@dataclass(frozen=True)
class ObfuscatorFactory:
    """Makes obfuscators for modulus ``n``; with ``p`` and ``q`` it uses CRT and PRF exponents.

    Picklable (plain ints and flags), so a process pool can run it; the tables, the PRF key and the seed are
    per-process and rebuilt on arrival (a new seed each time, so two processes never share a tag). It
    carries the secret primes when given them: only hand it to processes of the same device.
    """

    n: int
    p: int | None = None
    q: int | None = None
    fast: bool | None = None
    short: bool = True
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.n, self.p, self.q, self.fast, self.short))  # the cache is not sent

    @property
    def uses_crt(self) -> bool:
        return self.p is not None and self.q is not None

    @property
    def exponent_bits(self) -> int:
        return exponent_bits(self.n.bit_length())

    def _consts(self) -> dict[str, Any]:
        if not self._cache:  # built aside, then published in one dict.update (atomic under the GIL)
            ops = IntOps(self.fast)
            c: dict[str, Any] = {"ops": ops, "n": ops.big(self.n)}
            c["nsq"] = c["n"] * c["n"]
            if self.p is not None and self.q is not None:
                p, q = ops.big(self.p), ops.big(self.q)
                c["p"], c["q"], c["p2"], c["q2"] = p, q, p * p, q * q
                c["p2inv"] = ops.invert(c["p2"], c["q2"])  # (p²)^-1 mod q² for Garner's CRT
                c["pinv_q"] = ops.invert(p, q)
            if self.short:
                self._short_consts(c)
            self._cache.update(c)
        return self._cache

    def _short_consts(self, c: dict[str, Any]) -> None:
        ops: IntOps = c["ops"]
        bits = self.exponent_bits
        nbytes = (self.n.bit_length() + 7) // 8
        if "p" in c:
            secret = int(self.p).to_bytes(nbytes, "big") + int(self.q).to_bytes(nbytes, "big")  # type: ignore[arg-type]
            salt = self.n.to_bytes(nbytes, "big")
            y = int.from_bytes(_hkdf(secret, salt, _BASE_INFO, nbytes + 16), "big") % self.n
            c["prf_key"] = _hkdf(secret, salt, _PRF_INFO, 32)
            c["exponent_bytes"] = bits // 8
            c["seed"], c["counter"] = os.urandom(SEED_BYTES), itertools.count()
            c["aside_seed"], c["aside_counter"] = os.urandom(SEED_BYTES), itertools.count()
            bits += SUM_HEADROOM_BITS  # the tables also serve sums of exponents (open)
            c["tp"] = FixedBase(ops, ops.powmod(ops.big(y), c["n"], c["p2"]), c["p2"], bits)
            c["tq"] = FixedBase(ops, ops.powmod(ops.big(y), c["n"], c["q2"]), c["q2"], bits)
        else:
            y = secrets.randbelow(self.n - 2) + 2
            c["t"] = FixedBase(ops, ops.powmod(ops.big(y), c["n"], c["nsq"]), c["nsq"], bits)

    def exponent(self, tag: Tag) -> int:
        """α for ``tag``: keyed BLAKE2b of seed | index, ℓ bits (secret primes only)."""
        c = self._cache or self._consts()  # called once per obfuscator of every aggregate a device opens
        seed, index = tag
        digest = hashlib.blake2b(
            seed + index.to_bytes(8, "big"), key=c["prf_key"], digest_size=c["exponent_bytes"]
        ).digest()
        return int.from_bytes(digest, "big")

    def _crt(self, c: dict[str, Any], a: Any, b: Any) -> Any:
        """Garner: the x below n² with x ≡ a (mod p²), x ≡ b (mod q²)."""
        return a + c["p2"] * (((b - a) * c["p2inv"]) % c["q2"])

    def make_one(self, aside: bool = False) -> Obfuscator:
        """One obfuscator. ``aside``: under a second seed and counter of this factory, for the ones a
        device makes on the spot because its pool ran short. The pool's worker keeps the first seed to
        itself, so the pool hands out one run of consecutive indices round after round, which is what
        :func:`next_coins` guesses (sharing the counter, a short round's own obfuscators left a gap in the
        pool's sequence that the next guess but one took for the worker's reserved indices)."""
        c = self._consts()
        ops: IntOps = c["ops"]
        n = c["n"]
        tag: Tag | None = None
        if self.short and "p" in c:
            seed, counter = (c["aside_seed"], c["aside_counter"]) if aside else (c["seed"], c["counter"])
            tag = (seed, next(counter))
            alpha = self.exponent(tag)
            x = self._crt(c, c["tp"].pow(alpha), c["tq"].pow(alpha))
        elif self.short:
            x = c["t"].pow(secrets.randbits(self.exponent_bits))
        elif "p" in c:
            a = ops.powmod(ops.big(secrets.randbelow(self.p - 1) + 1), c["p"], c["p2"])  # type: ignore[operator]
            b = ops.powmod(ops.big(secrets.randbelow(self.q - 1) + 1), c["q"], c["q2"])  # type: ignore[operator]
            x = self._crt(c, a, b)
        else:
            x = ops.powmod(ops.big(secrets.randbelow(self.n - 1) + 1), n, c["nsq"])
        return Obfuscator(x, x % n, tag)

    def make(self, count: int, aside: bool = False) -> list[Obfuscator]:
        return [self.make_one(aside) for _ in range(int(count))]

    def make_portable(self, count: int) -> list[tuple[int, int, Tag | None]]:
        """Like :meth:`make` but as Python ints, for sending between processes."""
        return [(int(o.x), int(o.xn), o.tag) for o in self.make(count)]

    def from_portable(self, items: Sequence[tuple[int, int, Tag | None]]) -> list[Obfuscator]:
        big = self._consts()["ops"].big
        return [Obfuscator(big(x), big(xn), tag) for x, xn, tag in items]

    @property
    def can_open(self) -> bool:
        """Whether :meth:`open` can work: secret primes and PRF exponents."""
        return self.short and self.uses_crt

    def open(self, c: Any, exponent_sum: int) -> int | None:
        """m from ``c = (1 + n·m)·h^A mod n²`` with A = ``exponent_sum`` known, or None if c is not of that
        form (then decrypt it the classic way): :meth:`opening` then :meth:`open_with`."""
        opening = self.opening(exponent_sum)
        return None if opening is None else self.open_with(c, opening)

    def opening(self, exponent_sum: int) -> Opening | None:
        """What :meth:`open_with` needs to open any ciphertext whose obfuscators' exponents sum to A =
        ``exponent_sum``, or None when this factory cannot open (public key only, classic obfuscators) or A
        is beyond the tables. The expensive half of an opening (two fixed-base powers and two inverses), so
        it can be made ahead of the ciphertext. Secret: it is derived from the primes and the PRF key."""
        k = self._consts()
        if not self.can_open or exponent_sum < 0 or exponent_sum.bit_length() > 8 * len(k["tp"].rows):
            return None
        ops: IntOps = k["ops"]
        halves = []
        for prime, other, table in (("p", "q", "tp"), ("q", "p", "tq")):
            p = k[prime]
            x = k[table].pow(exponent_sum)
            halves.append((x, x % p, ops.invert(x * k[other] % p, p)))
        (xp, xp1, ip), (xq, xq1, iq) = halves
        return Opening(xp, xp1, ip, xq, xq1, iq)

    def open_with(self, c: Any, opening: Opening) -> int | None:
        """m from ``c = (1 + n·m)·h^A mod n²`` given ``opening`` = :meth:`opening` (A), or None if c is not
        of that form.

        Per prime, with ``x = h^A mod p²``: ``(1 + n)^m ≡ 1 + p·u (mod p²)`` with ``u = q·m mod p``, so
        ``c ≡ x + p·(u·x mod p)``; hence c ≡ x (mod p) must hold (the check), and
        ``m ≡ ((c − x mod p²)/p)·(x·q)^-1 (mod p)``, an inverse modulo p only. CRT joins the two primes.
        """
        k = self._consts()
        c = k["ops"].big(c)
        p, q = k["p"], k["q"]
        xp, xp1, ip, xq, xq1, iq = opening
        if c % p != xp1 or c % q != xq1:
            return None
        mp = (c - xp) % k["p2"] // p * ip % p
        mq = (c - xq) % k["q2"] // q * iq % q
        return int(mp + p * ((mq - mp) * k["pinv_q"] % q))


class Opening(NamedTuple):
    """Per prime r of (p, q): ``x = h^A mod r²``, ``x mod r`` and ``(x·r')^-1 mod r`` (r' the other prime)."""

    xp: Any
    xp_mod_p: Any
    inv_p: Any
    xq: Any
    xq_mod_q: Any
    inv_q: Any


def pack_coins(tags: Sequence[Tag | None]) -> bytes:
    """The tags of a contribution's ciphertexts, in order, as runs of consecutive indices under one seed
    (``COIN_RUN`` each); empty when any tag is missing (then nobody can open those ciphertexts early)."""
    if not tags or any(t is None for t in tags):
        return b""
    runs: list[list[Any]] = []
    for seed, index in tags:  # type: ignore[misc]
        if runs and runs[-1][0] == seed and runs[-1][1] + runs[-1][2] == index:
            runs[-1][2] += 1
        else:
            runs.append([seed, index, 1])
    return b"".join(COIN_RUN.pack(seed, start, count) for seed, start, count in runs)


def unpack_coins(data: bytes, count: int) -> list[Tag]:
    """The ``count`` tags that :func:`pack_coins` wrote; :class:`CiphertextError` on anything else."""
    if len(data) % COIN_RUN.size or len(data) // COIN_RUN.size > max(count, 0):
        raise CiphertextError(f"coins of {len(data)} bytes are not runs for {count} ciphertexts")
    tags: list[Tag] = []
    for seed, start, run in COIN_RUN.iter_unpack(data):
        if run < 1 or start + run > 2**64 or len(tags) + run > count:
            raise CiphertextError("coins name more ciphertexts than the contribution holds")
        tags.extend((seed, start + k) for k in range(run))
    if len(tags) != count:
        raise CiphertextError(f"coins name {len(tags)} ciphertexts, the contribution holds {count}")
    return tags


def next_coins(coins: bytes, count: int) -> bytes:
    """The coins a contributor whose last ``coins`` are these most likely sends next for ``count``
    ciphertexts; empty when unknown.

    A device takes its obfuscators from its pool first, in the order the pool made them, and makes
    whatever the pool lacks itself under a seed the pool does not use (:meth:`ObfuscatorFactory.make_one`,
    ``aside``), so the pool's sequence is the first run's seed and continues where that run ended. A
    contributor whose own obfuscators share the pool's seed and counter leaves a gap of indices its
    worker had reserved, which its pool hands out first: the guess is the
    indices of that seed after the first run that no run used, then the indices after the highest one
    used under that seed. With one run (a pool that kept up) that is the
    run's continuation. A pool that gave nothing at all (the first run already the device's own) is
    guessed wrong, which costs the next aggregate its prepared openings, never correctness.
    """
    if count < 1 or not coins or len(coins) % COIN_RUN.size:
        return b""
    runs = list(COIN_RUN.iter_unpack(coins))
    seed, first, length = runs[0]
    used = sorted((start, start + run) for s, start, run in runs if s == seed)
    out: list[tuple[int, int]] = []  # runs (first index, length), never adjacent: written as they are
    left, pos = count, first + length
    for start, end in used:
        if pos < start and left:  # skipped by this seed: the worker's reserved indices
            take = min(start - pos, left)
            out.append((pos, take))
            left -= take
        pos = max(pos, end)
    if left:
        top = max(end for _, end in used)
        if top + left > 2**64:
            return b""
        out.append((top, left))
    return b"".join(COIN_RUN.pack(seed, start, run) for start, run in out)


def raw_encrypt_with(m: Any, obfuscator: Obfuscator | tuple[Any, ...], n: Any, nsquare: Any) -> Any:
    """``(1 + n·m)·x mod n²`` for ``0 <= m < n`` as ``x + n·(m·(x mod n) mod n)`` (see module docstring).

    Not obfuscated by itself: safe only because ``x`` is a fresh obfuscator used once (hence ``raw_``).
    """
    x, xn = obfuscator[0], obfuscator[1]
    c = x + n * ((m * xn) % n)
    return c - nsquare if c >= nsquare else c
