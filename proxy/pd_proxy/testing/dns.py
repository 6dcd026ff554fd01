"""A minimal DNS server and client over UDP (RFC 1035), for discovery tests on loopback.

``DnsServer`` answers A and AAAA questions from ``records`` (name -> addresses), and PTR
questions from the same table (``<reversed address>.in-addr.arpa`` -> names), which a test
changes while the proxy runs: a name missing from it gets NXDOMAIN, one in ``silent`` gets no
answer at all (a timeout), one in ``servfail`` gets SERVFAIL. ``UdpResolver`` is a resolver for
pd_proxy.discovery.watch that asks such a server directly, so tests need neither root, nor
``/etc/resolv.conf``, nor a DNS library. Only what those two need is implemented: one question per
message, no TCP fallback, no EDNS; names in answers may be compressed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct

A, PTR, AAAA = 1, 12, 28
CLASS_IN = 1
NOERROR, SERVFAIL, NXDOMAIN = 0, 2, 3
RCODE_NAMES = {NOERROR: "NOERROR", 1: "FORMERR", SERVFAIL: "SERVFAIL", NXDOMAIN: "NXDOMAIN"}
_HEADER = struct.Struct("!HHHHHH")  # id, flags, qdcount, ancount, nscount, arcount
_QUESTION_TAIL = struct.Struct("!HH")  # qtype, qclass
_ANSWER_TAIL = struct.Struct("!HHIH")  # type, class, ttl, rdlength


class DnsError(OSError):
    """The server answered with an error code, or with something that is not an answer."""


def encode_name(name: str) -> bytes:
    """``www.example.com`` as length-prefixed labels ending in a zero byte."""
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label {label!r} in {name!r}")
        out += bytes((len(raw),)) + raw
    return bytes(out + b"\0")


def read_name(msg: bytes, offset: int) -> tuple[str, int]:
    """The name at ``offset`` (following compression pointers) and the offset just after it."""
    labels: list[str] = []
    end = None  # where the name ends in the message, once a pointer was followed
    for _ in range(128):  # a pointer loop ends here instead of spinning
        if offset >= len(msg):
            raise DnsError("truncated name")
        length = msg[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(msg):
                raise DnsError("truncated name pointer")
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | msg[offset + 1]
            continue
        if length & 0xC0:
            raise DnsError(f"unsupported label type {length:#x}")
        if length == 0:
            return ".".join(labels), (offset + 1 if end is None else end)
        labels.append(msg[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    raise DnsError("name compression loop")


def build_query(qid: int, name: str, qtype: int) -> bytes:
    """A recursive query for one ``qtype`` record of ``name``."""
    header = _HEADER.pack(qid, 0x0100, 1, 0, 0, 0)  # RD set
    return header + encode_name(name) + _QUESTION_TAIL.pack(qtype, CLASS_IN)


def parse_query(msg: bytes) -> tuple[int, str, int, int]:
    """(id, name, qtype, end of the question) of a one-question query."""
    if len(msg) < _HEADER.size:
        raise DnsError("short message")
    qid, flags, qdcount, *_ = _HEADER.unpack_from(msg)
    if flags & 0x8000 or qdcount != 1:
        raise DnsError("not a one-question query")
    name, offset = read_name(msg, _HEADER.size)
    qtype, _qclass = _QUESTION_TAIL.unpack_from(msg, offset)
    return qid, name, qtype, offset + _QUESTION_TAIL.size


def build_response(query: bytes, addresses: list[str], rcode: int = NOERROR, ttl: int = 0) -> bytes:
    """The answer to ``query``: its question, then one record per address of the asked type
    (for PTR, ``addresses`` are the names)."""
    qid, _name, qtype, end = parse_query(query)
    want = 4 if qtype == A else 6 if qtype == AAAA else None
    records = []
    for address in addresses if rcode == NOERROR else []:
        if qtype == PTR:
            rdata = encode_name(address)
            records.append(
                b"\xc0\x0c" + _ANSWER_TAIL.pack(qtype, CLASS_IN, ttl, len(rdata)) + rdata
            )
            continue
        ip = ipaddress.ip_address(address)
        if ip.version == want:
            rdata = ip.packed
            # 0xC00C: the name is the question's, at offset 12.
            records.append(
                b"\xc0\x0c" + _ANSWER_TAIL.pack(qtype, CLASS_IN, ttl, len(rdata)) + rdata
            )
    flags = 0x8180 | rcode  # QR, RD, RA
    header = _HEADER.pack(qid, flags, 1, len(records), 0, 0)
    return header + query[_HEADER.size : end] + b"".join(records)


def parse_response(msg: bytes, qid: int, qtype: int) -> list[str]:
    """The ``qtype`` addresses in a response to query ``qid``; ``DnsError`` for an error code."""
    if len(msg) < _HEADER.size:
        raise DnsError("short response")
    rid, flags, qdcount, ancount, _ns, _ar = _HEADER.unpack_from(msg)
    if rid != qid or not flags & 0x8000:
        raise DnsError("not the response to this query")
    rcode = flags & 0x000F
    if rcode != NOERROR:
        raise DnsError(RCODE_NAMES.get(rcode, f"rcode {rcode}"))
    offset = _HEADER.size
    for _ in range(qdcount):
        _name, offset = read_name(msg, offset)
        offset += _QUESTION_TAIL.size
    addresses = []
    for _ in range(ancount):
        _name, offset = read_name(msg, offset)
        if offset + _ANSWER_TAIL.size > len(msg):
            raise DnsError("truncated answer")
        rtype, _rclass, _ttl, length = _ANSWER_TAIL.unpack_from(msg, offset)
        offset += _ANSWER_TAIL.size
        rdata = msg[offset : offset + length]
        offset += length
        if len(rdata) != length:
            raise DnsError("truncated answer data")
        if rtype == qtype == A and length == 4:
            addresses.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == qtype == AAAA and length == 16:
            addresses.append(str(ipaddress.IPv6Address(rdata)))
        # Other records (a CNAME before the addresses, say) are skipped.
    return addresses


class _ServerProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.server.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class DnsServer:
    """Authoritative for whatever ``records`` holds; names are compared in lower case."""

    def __init__(self, records: dict[str, list[str]] | None = None) -> None:
        self.records: dict[str, list[str]] = dict(records or {})
        self.silent: set[str] = set()
        self.servfail: set[str] = set()
        self.queries: list[tuple[str, int]] = []  # (name, qtype) in arrival order
        self.address: tuple[str, int] = ("127.0.0.1", 0)
        self._transport: asyncio.DatagramTransport | None = None

    def answer(self, query: bytes) -> bytes | None:
        try:
            _qid, name, qtype, _end = parse_query(query)
        except (DnsError, struct.error):
            return None
        name = name.lower().rstrip(".")
        self.queries.append((name, qtype))
        if name in self.silent:
            return None
        if name in self.servfail:
            return build_response(query, [], SERVFAIL)
        if name not in self.records:
            return build_response(query, [], NXDOMAIN)
        return build_response(query, self.records[name])

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _ServerProtocol(self), local_addr=(host, port)
        )
        self._transport = transport
        self.address = transport.get_extra_info("sockname")[:2]
        return self.address

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class _ClientProtocol(asyncio.DatagramProtocol):
    def __init__(self, qid: int, qtype: int) -> None:
        self.qid = qid
        self.qtype = qtype
        self.result: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.result.done():
            return
        try:
            self.result.set_result(parse_response(data, self.qid, self.qtype))
        except DnsError as exc:
            if str(exc) == "not the response to this query":
                return  # a stray or late datagram: keep waiting for ours
            self.result.set_exception(exc)

    def error_received(self, exc: Exception) -> None:
        if not self.result.done():
            self.result.set_exception(exc)


class UdpResolver:
    """A pd_proxy.discovery.watch resolver asking one DNS server for A and AAAA records."""

    def __init__(
        self, server: tuple[str, int], timeout: float = 1.0, qtypes: tuple[int, ...] = (A, AAAA)
    ) -> None:
        self.server = server
        self.timeout = timeout
        self.qtypes = qtypes

    async def __call__(self, host: str) -> list[str]:
        answers = await asyncio.gather(*(self.query(host, qtype) for qtype in self.qtypes))
        return [address for answer in answers for address in answer]

    async def query(self, host: str, qtype: int) -> list[str]:
        """One question; ``DnsError`` for an error code, ``TimeoutError`` without an answer."""
        loop = asyncio.get_running_loop()
        qid = int.from_bytes(os.urandom(2), "big")
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _ClientProtocol(qid, qtype), remote_addr=self.server
        )
        try:
            transport.sendto(build_query(qid, host, qtype))
            return await asyncio.wait_for(protocol.result, self.timeout)
        finally:
            transport.close()
