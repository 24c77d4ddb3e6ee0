/* agentd data-plane fast path: the per-packet loops of the user-space UDP and IPIP workers in C.
 *
 * The Python worker (agentd/dataplane/worker.py) owns everything else: the TUN device, the
 * sockets, the control channel, the next-hop table, ICMP errors, statistics and every fall-back.
 * This file only moves packets, through a handful of plain C functions called with ctypes
 * (agentd/dataplane/_fast.py): fp_run is the worker's poll loop, draining the TUN (fp_tx) and
 * the underlay socket (fp_rx) until a control socket needs Python.  What it cannot finish (a
 * packet that needs an ICMP error) it hands back to Python, at most ICMP_RATE a second.
 *
 * Inner packets are IPv4, and IPv6 where the backend carries it (udp: st->ipv6; ipip is IPv4 in
 * IPv4 only): the outer header is IPv4 either way, the underlay's.
 *
 * TUN -> underlay: the TUN has IFF_VNET_HDR and TSO, so one read returns a TCP super-packet (IPv4
 * or IPv6) of up to 64 KB; it is cut into MTU-sized segments exactly as Linux tcp_gso_segment
 * does (IPv4 ID +1 per segment, IPv6 payload length per segment and no header checksum, sequence
 * number +MSS, CWR on the first only, FIN/PSH on the last only, every checksum complete), and the
 * segments of a batch of reads leave in one sendmmsg: for UDP in
 * messages of up to 64 equal segments with a UDP_SEGMENT control message (the kernel cuts each
 * into one datagram per segment: flannel's wire format; consecutive super-packets share a
 * message where their segments line up), for IPIP one message per segment (raw sockets have
 * no GSO).
 *
 * Underlay -> TUN: a UDP GRO read (or a recvmmsg batch of IPIP packets) is cut into its inner
 * packets, each of which must come from a member and carry a source that routes back to that
 * member (source_ok: else dropped as spoofed); consecutive in-order segments of one TCP flow are merged as Linux tcp_gro_receive
 * would and written to the TUN as one super-packet (virtio-net header GSO_TCPV4 or GSO_TCPV6 +
 * NEEDS_CSUM)
 * with one writev whose iovecs point at the payloads where they were received: no copy.  As
 * there, every segment's checksums are validated first: one that fails is not merged but
 * written on its own with flags 0, for the pod's stack to drop (rx_csum_errors counts it).
 *
 * Python reference implementations of every step (agentd/dataplane/_forward.py, _tso.py,
 * _gro.py) stay the fall-back when this file is not built, and tests/unit/agentd/test_fastpath.py
 * holds the two equal byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define VNET_LEN 10
#define VNET_F_NEEDS_CSUM 1
#define VNET_GSO_NONE 0
#define VNET_GSO_TCPV4 1
#define VNET_GSO_TCPV6 4
#define SOL_UDP_ 17
#define UDP_SEGMENT_ 103
#define UDP_GRO_ 104
#define TCP_FIN 0x01
#define TCP_PSH 0x08
#define TCP_ACK 0x10
#define TCP_CWR 0x80

#define KIND_UDP 0
#define KIND_IPIP 1

#define IN_SIZE (65536 + 64)
#define OUT_SIZE (4 << 20)
#define OUT_FLUSH (256 << 10)       /* send what is queued once this much is: it is still in L2 */
#define TX_IOV 1024                 /* UIO_MAXIOV: a TUN read into segment slots uses at most this many */
#define MIN_SLOT_GSO 128            /* smaller MSS: read contiguously and copy (more slots than TX_IOV) */
#define MAX_MSGS 1024
#define MAX_GSO_SEGMENTS 64
#define MAX_GSO_BYTES 65507
#define RX_UDP_SIZE (65536 + 4096)
#define RX_SLOTS 64
#define RX_SLOT 2048                /* an ipip receive slot at least (rx_slot) */
#define RX_AREA (1 << 19)
#define MAX_GRO_SEGMENTS 64         /* UDP_GRO_CNT_MAX */
#define MAX_PENDING 1024
#define MAX_RUN 64
#define MAX_IP_TOTAL 0xFFFF
#define SLOW_MAX 1600

/* Counter slots: the order is agentd/dataplane/_fast.py's COUNTERS. */
enum {
    C_TX_PACKETS, C_TX_BYTES, C_TX_SYSCALLS, C_RX_PACKETS, C_RX_BYTES, C_RX_SYSCALLS,
    C_TUN_READS, C_TUN_WRITES, C_TSO_FRAMES, C_TSO_SEGMENTS, C_TSO_BATCHES, C_COALESCED,
    C_COALESCED_BATCHES, C_RX_CSUM_ERRORS,
    D_NON_MEMBER, D_NO_ROUTE, D_TTL_EXCEEDED, D_MALFORMED, D_MTU, D_NOT_IPV4, D_SEND_ERROR,
    D_TUN_WRITE_ERROR, D_ICMP_RATELIMITED, D_SPOOFED,
    C_COUNT
};

/* ICMP errors are rate-limited as the kernel limits its own (net.ipv4.icmp_msgs_per_sec and
 * icmp_msgs_burst; RFC 4443 section 2.4 (f) requires it for ICMPv6): a token bucket in front of
 * every hand-back, so a pod that floods TTL-1 or unrouted packets costs the loop a counter
 * (drop:icmp_ratelimited), not a return to Python per packet.  _transmit.py's IcmpRateLimit is
 * the same bucket for the Python paths. */
#define ICMP_RATE 1000                      /* errors a second */
#define ICMP_BURST 50
#define ICMP_COST_NS (1000000000LL / ICMP_RATE)

/* What fp_tx hands back to Python. */
#define SLOW_NONE 0
#define SLOW_NET_UNREACHABLE 1
#define SLOW_TIME_EXCEEDED 2
#define SLOW_FRAG_NEEDED 3          /* over the path MTU: slow_peer says to whom */

struct fp_route { uint32_t net, mask, peer; };   /* network byte order */
struct fp_route6 { uint64_t net[2], mask[2]; uint32_t peer; };   /* bytes as in the header; peer network order */

struct fp_msg_meta { uint32_t peer; int segments; int bytes; int seglen; int gso; };

/* A longest-prefix table of both families, with its last look-up of each remembered: the next
 * hops (the transmit side's destinations) and the reverse-path table (source_ok: the receive
 * side's sources; every pod subnet the node routes to a peer node, whatever carries it). */
struct fp_cache { uint32_t addr, peer; int ok; };
struct fp_cache6 { uint64_t addr[2]; uint32_t peer; int ok; };
struct fp_table {
    struct fp_route *v4; int n4;
    struct fp_route6 *v6; int n6;
    struct fp_cache c4;
    struct fp_cache6 c6;
};

struct fp_state {
    /* set by Python (_fast.py's _State mirrors them; fp_fields below lets it check) */
    int tun_fd, sock_fd, kind, mtu, ttl_decrement, udp_gso, udp_gro;
    int ipv6;                        /* IPv6 inner packets are carried (udp), else dropped as not_ipv4 */
    uint16_t port;                   /* network byte order */
    uint64_t counters[C_COUNT];
    int slow_kind, slow_len;
    uint8_t slow[SLOW_MAX];
    int gso_failed_errno;            /* non-zero once a UDP_SEGMENT send was refused */
    uint32_t slow_peer;              /* SLOW_FRAG_NEEDED: the peer the packet was for (network order) */
    /* private */
    struct fp_table hops, sources;
    uint32_t *members; int nmembers;  /* host byte order, sorted */
    int64_t icmp_credit_ns, icmp_last_ns;    /* the ICMP error token bucket, in nanoseconds of rate */
    int ptb_len; uint32_t ptb_peer; uint8_t ptb[SLOW_MAX];   /* a packet too big, waiting (too_big) */
    uint8_t *in, *out, *rx, *ovf;
    int geo_hl, geo_gso;             /* the segment slots TUN reads go into (the last TSO geometry) */
    struct iovec tiov[TX_IOV];
    int out_used, nmsgs;
    struct mmsghdr msgs[MAX_MSGS];
    struct iovec iovs[MAX_MSGS];
    struct sockaddr_in names[MAX_MSGS];
    char cmsgs[MAX_MSGS][CMSG_SPACE(sizeof(uint16_t))];
    struct fp_msg_meta meta[MAX_MSGS];
    struct mmsghdr rmsgs[RX_SLOTS];
    struct iovec riovs[RX_SLOTS];
    struct sockaddr_in rnames[RX_SLOTS];
};

/* -- checksums (RFC 1071): sums of native-order words, stored in native order ------------------ */

static inline uint64_t sum_bytes(const uint8_t *p, size_t n, uint64_t s)
{
    for (; n >= 4; p += 4, n -= 4) {   /* gcc -O3 vectorizes this */
        uint32_t a;
        memcpy(&a, p, 4);
        s += a;
    }
    if (n >= 2) {
        uint16_t a;
        memcpy(&a, p, 2);
        s += a;
        p += 2;
        n -= 2;
    }
    if (n) {
        uint8_t tail[2] = {p[0], 0};
        uint16_t a;
        memcpy(&a, tail, 2);
        s += a;
    }
    return s;
}

static inline uint16_t fold(uint64_t s)
{
    s = (s & 0xFFFFFFFFu) + (s >> 32);
    s = (s & 0xFFFFFFFFu) + (s >> 32);
    s = (s & 0xFFFF) + (s >> 16);
    s = (s & 0xFFFF) + (s >> 16);
    return (uint16_t)s;
}

static inline void put_csum(uint8_t *at, uint64_t s)
{
    uint16_t v = (uint16_t)~fold(s);
    memcpy(at, &v, 2);
}

/* The pseudo header of the IPv4 (ihl 20) or IPv6 (ihl 40; RFC 8200 section 8.1) packet at ip. */
static inline uint64_t pseudo_sum(const uint8_t *ip, int ihl, uint8_t proto, uint32_t length)
{
    uint64_t s = ihl == 40 ? sum_bytes(ip + 8, 32, 0) : sum_bytes(ip + 12, 8, 0);
    s += htons(proto);
    s += htons((uint16_t)length);
    return s;
}

static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static inline void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v & 0xFF; }
static inline void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }

static inline void ip_checksum(uint8_t *ip, int ihl)
{
    ip[10] = ip[11] = 0;
    put_csum(ip + 10, sum_bytes(ip, ihl, 0));
}

/* RFC 1624 eqn. 3 for the TTL/protocol word, as proto.packet.decrement_ttl. */
static inline void decrement_ttl(uint8_t *ip)
{
    uint32_t word = (uint32_t)ip[8] << 8 | ip[9];
    uint32_t s = (~(uint32_t)get16(ip + 10) & 0xFFFF) + (~word & 0xFFFF) + (word - 0x100);
    s = (s & 0xFFFF) + (s >> 16);
    s = (s & 0xFFFF) + (s >> 16);
    ip[8] -= 1;
    put16(ip + 10, (uint16_t)(~s & 0xFFFF));
}

/* -- segmentation -------------------------------------------------------------------------------- */

/* Cut a TCP super-packet of n bytes (headers: ihl + thl bytes at hdr_in, IPv4 or with v6 IPv6;
 * payload chunk i of gso bytes at payload + i * step) into segments back to back from out.  With
 * payload == out + hl and step == hl + gso the payload is already where the segments want it
 * (the worker reads the TUN that way) and only the headers are written. */
static int segment(const uint8_t *hdr_in, int n, int ihl, int thl, int v6, const uint8_t *payload, int step,
                   int gso, uint8_t *out, int out_len, int ttl_decrement, int *seglen, int *total)
{
    int hl = ihl + thl;
    int plen = n - hl;
    int count = plen ? (plen + gso - 1) / gso : 1;
    int tot = plen + count * hl;
    int hop_at = v6 ? 7 : 8;   /* IPv6's hop limit, IPv4's TTL */
    if (tot > out_len)
        return -3;
    if (ttl_decrement && hdr_in[hop_at] <= 1)
        return -2;

    uint8_t hdr[120];
    memcpy(hdr, hdr_in, hl);
    if (ttl_decrement)
        hdr[hop_at] -= 1;
    uint16_t id0 = v6 ? 0 : get16(hdr + 4);
    uint32_t seq0 = get32(hdr + ihl + 4);
    uint8_t flags = hdr[ihl + 13];
    uint8_t mid = flags & ~(TCP_FIN | TCP_PSH | TCP_CWR);
    uint64_t pseudo = (v6 ? sum_bytes(hdr + 8, 32, 0) : sum_bytes(hdr + 12, 8, 0)) + htons(IPPROTO_TCP);
    hdr[ihl + 16] = hdr[ihl + 17] = 0;

    uint8_t *o = out;
    const uint8_t *src = payload;
    for (int i = 0; i < count; i++) {
        int clen = plen - i * gso < gso ? plen - i * gso : gso;
        memcpy(o, hdr, hl);
        if (o + hl != src)
            memmove(o + hl, src, clen);
        src += step;
        if (v6) {
            put16(o + 4, (uint16_t)(hl - 40 + clen));   /* the payload length; no header checksum */
        } else {
            put16(o + 2, (uint16_t)(hl + clen));
            put16(o + 4, (uint16_t)(id0 + i));
            ip_checksum(o, ihl);
        }
        uint8_t f = mid;
        if (i == 0)
            f |= flags & TCP_CWR;
        if (i == count - 1)
            f |= flags & (TCP_FIN | TCP_PSH);
        o[ihl + 13] = f;
        put32(o + ihl + 4, seq0 + (uint32_t)i * (uint32_t)gso);
        uint64_t s = pseudo + htons((uint16_t)(thl + clen));
        s = sum_bytes(o + ihl, thl + clen, s);
        put_csum(o + ihl + 16, s);
        o += hl + clen;
    }
    *seglen = count > 1 ? hl + gso : tot;
    *total = tot;
    return count;
}

/* The header lengths of a TCP/IPv4 packet of n bytes, or (with ipv6) of a TCP/IPv6 one whose next
 * header is TCP (no extension headers), or -1 when it is neither. */
static inline int tcp_headers(const uint8_t *pkt, int n, int ipv6, int *ihl, int *thl)
{
    if (n >= 40 && pkt[0] >> 4 == 4 && pkt[9] == IPPROTO_TCP)
        *ihl = (pkt[0] & 0x0F) << 2;
    else if (ipv6 && n >= 60 && pkt[0] >> 4 == 6 && pkt[6] == IPPROTO_TCP)
        *ihl = 40;
    else
        return -1;
    if (*ihl < 20 || *ihl + 13 >= n)
        return -1;
    *thl = (pkt[*ihl + 12] >> 4) << 2;
    if (*thl < 20 || *ihl + *thl > n)
        return -1;
    return 0;
}

/* Cut the TCP super-packet pkt[0:n] (IPv4 or IPv6) into segments of at most gso payload bytes,
 * back to back from out.  Returns the segment count (and *seglen, *total as segment_tcp does),
 * or -1 when malformed, -2 when the TTL (hop limit) is exhausted, -3 when out is too small. */
int fp_segment(const uint8_t *pkt, int n, int gso, uint8_t *out, int out_len, int ttl_decrement,
               int *seglen, int *total)
{
    int ihl, thl;
    if (tcp_headers(pkt, n, 1, &ihl, &thl) || gso <= 0)
        return -1;
    return segment(pkt, n, ihl, thl, pkt[0] >> 4 == 6, pkt + ihl + thl, gso, gso, out, out_len, ttl_decrement,
                   seglen, total);
}

/* -- next hops and members ----------------------------------------------------------------------- */

/* n triples (net, mask, peer) in network byte order, longest prefix first. */
static int table_set4(struct fp_table *t, const uint32_t *triples, int n)
{
    struct fp_route *r = n ? malloc(sizeof(*r) * (size_t)n) : NULL;
    if (n && !r)
        return -1;
    for (int i = 0; i < n; i++) {
        r[i].net = triples[3 * i];
        r[i].mask = triples[3 * i + 1];
        r[i].peer = triples[3 * i + 2];
    }
    free(t->v4);
    t->v4 = r;
    t->n4 = n;
    t->c4.ok = 0;
    return 0;
}

/* n entries of 36 bytes (prefix 16, mask 16, as in the header; peer 4, network byte order),
 * longest prefix first. */
static int table_set6(struct fp_table *t, const uint8_t *entries, int n)
{
    struct fp_route6 *r = n ? malloc(sizeof(*r) * (size_t)n) : NULL;
    if (n && !r)
        return -1;
    for (int i = 0; i < n; i++) {
        const uint8_t *e = entries + 36 * i;
        memcpy(r[i].net, e, 16);
        memcpy(r[i].mask, e + 16, 16);
        memcpy(&r[i].peer, e + 32, 4);
    }
    free(t->v6);
    t->v6 = r;
    t->n6 = n;
    t->c6.ok = 0;
    return 0;
}

/* The next hops (IPv4, IPv6) and the reverse-path table (IPv4, IPv6), as table_set4/6 take them. */
int fp_set_routes(struct fp_state *st, const uint32_t *triples, int n) { return table_set4(&st->hops, triples, n); }
int fp_set_routes6(struct fp_state *st, const uint8_t *entries, int n) { return table_set6(&st->hops, entries, n); }
int fp_set_sources(struct fp_state *st, const uint32_t *triples, int n) { return table_set4(&st->sources, triples, n); }
int fp_set_sources6(struct fp_state *st, const uint8_t *entries, int n) { return table_set6(&st->sources, entries, n); }

/* members: n underlay addresses in host byte order, sorted ascending. */
int fp_set_members(struct fp_state *st, const uint32_t *addrs, int n)
{
    uint32_t *m = n ? malloc(sizeof(*m) * (size_t)n) : NULL;
    if (n && !m)
        return -1;
    if (n)
        memcpy(m, addrs, sizeof(*m) * (size_t)n);
    free(st->members);
    st->members = m;
    st->nmembers = n;
    return 0;
}

/* The peer for the IPv4 address dst (network byte order) in t, 0 when none (a peer is never
 * 0.0.0.0: the control protocol takes unicast next hops only). */
static inline uint32_t table_lookup4(struct fp_table *t, uint32_t dst)
{
    if (t->c4.ok && t->c4.addr == dst)
        return t->c4.peer;
    uint32_t peer = 0;
    for (int i = 0; i < t->n4; i++) {
        if ((dst & t->v4[i].mask) == t->v4[i].net) {
            peer = t->v4[i].peer;
            break;
        }
    }
    t->c4.addr = dst;
    t->c4.peer = peer;
    t->c4.ok = 1;
    return peer;
}

/* The peer for the IPv6 address at dst (16 bytes as in the header) in t, 0 when none. */
static inline uint32_t table_lookup6(struct fp_table *t, const uint8_t *dst)
{
    uint64_t d[2];
    memcpy(d, dst, 16);
    if (t->c6.ok && t->c6.addr[0] == d[0] && t->c6.addr[1] == d[1])
        return t->c6.peer;
    uint32_t peer = 0;
    for (int i = 0; i < t->n6; i++) {
        const struct fp_route6 *r = &t->v6[i];
        if ((d[0] & r->mask[0]) == r->net[0] && (d[1] & r->mask[1]) == r->net[1]) {
            peer = r->peer;
            break;
        }
    }
    memcpy(t->c6.addr, d, 16);
    t->c6.peer = peer;
    t->c6.ok = 1;
    return peer;
}

static uint32_t lookup(struct fp_state *st, uint32_t dst) { return table_lookup4(&st->hops, dst); }
static uint32_t lookup6(struct fp_state *st, const uint8_t *dst) { return table_lookup6(&st->hops, dst); }

/* The receive side's reverse-path check (_forward.py's NextHopTable.source_ok): may the inner
 * packet p (inner_ok took it: IPv4, or IPv6) come from the member whose underlay address is
 * from (network byte order)?  Only where its source lies in a prefix the node routes to that
 * member (st->sources) -- its pods; its tunnel device's address, which its host's own packets,
 * its node ports' SNAT and its kernel's ICMP errors come from -- or is that member's own
 * address.  Anything else would pose as another node's pods or as this node (the TUN takes
 * local sources: accept_local). */
static inline int source_ok(struct fp_state *st, const uint8_t *p, uint32_t from)
{
    if (p[0] >> 4 == 4) {
        uint32_t src;
        memcpy(&src, p + 12, 4);
        return src == from || table_lookup4(&st->sources, src) == from;
    }
    return table_lookup6(&st->sources, p + 8) == from;
}

static int is_member(const struct fp_state *st, uint32_t addr_net)
{
    uint32_t a = ntohl(addr_net);
    int lo = 0, hi = st->nmembers - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        uint32_t m = st->members[mid];
        if (m == a)
            return 1;
        if (m < a)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return 0;
}

/* -- state ---------------------------------------------------------------------------------------- */

struct fp_state *fp_new(void)
{
    struct fp_state *st = calloc(1, sizeof(*st));
    if (!st)
        return NULL;
    st->in = malloc(IN_SIZE);
    st->ovf = malloc(IN_SIZE);
    st->out = malloc(OUT_SIZE);
    st->rx = malloc(RX_AREA);
    if (!st->in || !st->out || !st->rx || !st->ovf) {
        free(st->in);
        free(st->ovf);
        free(st->out);
        free(st->rx);
        free(st);
        return NULL;
    }
    st->tun_fd = st->sock_fd = -1;
    return st;
}

void fp_free(struct fp_state *st)
{
    if (!st)
        return;
    free(st->hops.v4);
    free(st->hops.v6);
    free(st->sources.v4);
    free(st->sources.v6);
    free(st->members);
    free(st->in);
    free(st->ovf);
    free(st->out);
    free(st->rx);
    free(st);
}

int fp_counters_offset(void) { return (int)offsetof(struct fp_state, counters); }
int fp_counter_count(void) { return C_COUNT; }

/* The layout of the fields Python sets and reads (_fast.py's _State checks every one of them,
 * name, offset and size, at load time: the C struct is the one source of truth). */
struct fp_field { const char *name; int offset, size; };
#define FP_FIELD(f) {#f, (int)offsetof(struct fp_state, f), (int)sizeof(((struct fp_state *)0)->f)}
static const struct fp_field fp_fields[] = {
    FP_FIELD(tun_fd), FP_FIELD(sock_fd), FP_FIELD(kind), FP_FIELD(mtu), FP_FIELD(ttl_decrement),
    FP_FIELD(udp_gso), FP_FIELD(udp_gro), FP_FIELD(ipv6), FP_FIELD(port), FP_FIELD(counters), FP_FIELD(slow_kind),
    FP_FIELD(slow_len), FP_FIELD(slow), FP_FIELD(gso_failed_errno), FP_FIELD(slow_peer),
};
#undef FP_FIELD
int fp_field_count(void) { return (int)(sizeof fp_fields / sizeof fp_fields[0]); }
const char *fp_field_name(int i) { return i >= 0 && i < fp_field_count() ? fp_fields[i].name : NULL; }
int fp_field_offset(int i) { return i >= 0 && i < fp_field_count() ? fp_fields[i].offset : -1; }
int fp_field_size(int i) { return i >= 0 && i < fp_field_count() ? fp_fields[i].size : -1; }

/* -- transmit -------------------------------------------------------------------------------------- */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Whether an ICMP error may go now (takes a token), else counts it as rate-limited. */
static int icmp_allowed(struct fp_state *st)
{
    int64_t now = now_ns(), credit = st->icmp_credit_ns + (now - st->icmp_last_ns);
    if (credit > ICMP_BURST * ICMP_COST_NS || credit < 0)   /* full (also the first time) */
        credit = ICMP_BURST * ICMP_COST_NS;
    st->icmp_last_ns = now;
    if (credit < ICMP_COST_NS) {
        st->icmp_credit_ns = credit;
        st->counters[D_ICMP_RATELIMITED]++;
        return 0;
    }
    st->icmp_credit_ns = credit - ICMP_COST_NS;
    return 1;
}

/* A packet the underlay refused as longer than the path MTU (EMSGSIZE): kept (one at a time)
 * for Python, which tells its source the MTU it can use -- frag needed (RFC 1191) for IPv4 with
 * DF, packet too big (RFC 4443 section 3.2) for IPv6 -- as a kernel tunnel device does; without
 * it TCP on that path stalls until its own black-hole detection.  Rate-limited as every ICMP
 * error.  IPv4 without DF gets nothing (a router would fragment it; the worker does not). */
static void too_big(struct fp_state *st, const uint8_t *p, int len, uint32_t peer)
{
    if (st->ptb_len || len < 20)
        return;
    int v = p[0] >> 4;
    if (!(v == 6 || (v == 4 && (p[6] & 0x40))))
        return;
    if (!icmp_allowed(st))
        return;
    st->ptb_len = len < SLOW_MAX ? len : SLOW_MAX;
    memcpy(st->ptb, p, (size_t)st->ptb_len);
    st->ptb_peer = peer;
}


static void add_msg(struct fp_state *st, uint32_t peer, uint8_t *base, int bytes, int seglen, int segments)
{
    int i = st->nmsgs++;
    struct msghdr *h = &st->msgs[i].msg_hdr;
    st->iovs[i].iov_base = base;
    st->iovs[i].iov_len = (size_t)bytes;
    st->names[i].sin_family = AF_INET;
    st->names[i].sin_port = st->kind == KIND_UDP ? st->port : 0;
    st->names[i].sin_addr.s_addr = peer;
    h->msg_name = &st->names[i];
    h->msg_namelen = sizeof(struct sockaddr_in);
    h->msg_iov = &st->iovs[i];
    h->msg_iovlen = 1;
    h->msg_flags = 0;
    int gso = st->kind == KIND_UDP && st->udp_gso;
    if (gso) {
        struct cmsghdr *c = (struct cmsghdr *)st->cmsgs[i];
        c->cmsg_level = SOL_UDP_;
        c->cmsg_type = UDP_SEGMENT_;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t g = (uint16_t)seglen;
        memcpy(CMSG_DATA(c), &g, sizeof(g));
        h->msg_control = c;
        h->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
    } else {
        h->msg_control = NULL;
        h->msg_controllen = 0;
    }
    st->meta[i] = (struct fp_msg_meta){peer, segments, bytes, seglen, gso};
}

static int send_plain(struct fp_state *st, int i)
{
    /* One datagram per segment: UDP GSO was refused.  Returns how many went out. */
    struct fp_msg_meta *m = &st->meta[i];
    uint8_t *p = st->iovs[i].iov_base;
    int left = m->bytes, sent = 0;
    while (left > 0) {
        int len = left < m->seglen ? left : m->seglen;
        st->counters[C_TX_SYSCALLS]++;
        if (sendto(st->sock_fd, p, (size_t)len, 0, (struct sockaddr *)&st->names[i], sizeof(struct sockaddr_in)) < 0) {
            if (errno == EMSGSIZE) {
                st->counters[D_MTU]++;
                too_big(st, p, len, st->names[i].sin_addr.s_addr);
            } else {
                st->counters[D_SEND_ERROR]++;
            }
        } else {
            st->counters[C_TX_PACKETS]++;
            st->counters[C_TX_BYTES] += (uint64_t)len;
            sent++;
        }
        p += len;
        left -= len;
    }
    return sent;
}

static void flush(struct fp_state *st)
{
    int start = 0, n = st->nmsgs;
    while (start < n) {
        int sent = sendmmsg(st->sock_fd, st->msgs + start, (unsigned)(n - start), 0);
        st->counters[C_TX_SYSCALLS]++;
        if (sent < 0) {
            int err = errno;
            if (err == EINTR)
                continue;
            struct fp_msg_meta *m = &st->meta[start];
            if (m->gso && (err == EIO || err == EINVAL || err == ENOPROTOOPT || err == EOPNOTSUPP)) {
                /* The message goes again one datagram per segment.  EINVAL is also what kernels
                 * before the upstream "return -EMSGSIZE" change give segments longer than the
                 * path MTU (a lower MTU to one peer): GSO stays on then unless a plain send
                 * goes out (the kernel refused GSO itself); send_plain counts the drops (mtu).
                 * As udp.py's UdpTransport._gso_refused. */
                int went = send_plain(st, start);
                if (err == EINVAL && !went) {
                    start++;
                    continue;
                }
                st->udp_gso = 0;
                st->gso_failed_errno = err;
                for (int i = start + 1; i < n; i++)
                    send_plain(st, i);
                break;
            }
            st->counters[err == EMSGSIZE ? D_MTU : D_SEND_ERROR] += (uint64_t)m->segments;
            if (err == EMSGSIZE)
                too_big(st, st->iovs[start].iov_base, m->seglen < m->bytes ? m->seglen : m->bytes, m->peer);
            start++;
            continue;
        }
        for (int i = start; i < start + sent; i++) {
            st->counters[C_TX_PACKETS] += (uint64_t)st->meta[i].segments;
            st->counters[C_TX_BYTES] += (uint64_t)st->meta[i].bytes;
        }
        start += sent;
    }
    st->nmsgs = 0;
}

/* Queue the segments at base (count of them, seglen each but the last) to peer. */
static void queue_segments(struct fp_state *st, uint32_t peer, uint8_t *base, int count, int seglen, int total)
{
    if (st->kind == KIND_UDP && st->udp_gso) {
        int per = MAX_GSO_BYTES / seglen;
        if (per > MAX_GSO_SEGMENTS)
            per = MAX_GSO_SEGMENTS;
        if (per < 1)
            per = 1;
        /* Segments that follow on in the buffer from full segments of the same size to the same
         * peer join the last message: a TSO super-packet whose payload is a multiple of the MSS
         * (the usual case) leaves room in its last GSO send for the next one's segments. */
        int last = st->nmsgs - 1;
        if (last >= 0) {
            struct fp_msg_meta *m = &st->meta[last];
            if (m->gso && m->peer == peer && m->seglen == seglen && m->bytes == m->segments * seglen
                && (uint8_t *)st->iovs[last].iov_base + m->bytes == base && m->segments < per) {
                int segs = per - m->segments < count ? per - m->segments : count;
                int bytes = segs * seglen < total ? segs * seglen : total;
                m->segments += segs;
                m->bytes += bytes;
                st->iovs[last].iov_len += (size_t)bytes;
                base += bytes;
                total -= bytes;
                count -= segs;
            }
        }
        while (total > 0) {
            if (st->nmsgs == MAX_MSGS)
                flush(st);
            int segs = count < per ? count : per;
            int bytes = segs * seglen < total ? segs * seglen : total;
            add_msg(st, peer, base, bytes, seglen, segs);
            base += bytes;
            total -= bytes;
            count -= segs;
        }
        return;
    }
    for (int i = 0; i < count; i++) {
        if (st->nmsgs == MAX_MSGS)
            flush(st);
        int len = total < seglen ? total : seglen;
        add_msg(st, peer, base, len, len, 1);
        base += len;
        total -= len;
    }
}

/* Hand Python the packet too_big kept (returns 1). */
static int hand_back_too_big(struct fp_state *st)
{
    st->slow_kind = SLOW_FRAG_NEEDED;
    st->slow_len = st->ptb_len;
    memcpy(st->slow, st->ptb, (size_t)st->ptb_len);
    st->slow_peer = st->ptb_peer;
    st->ptb_len = 0;
    return 1;
}

/* Hand the packet back to Python for an ICMP error (returns 1: fp_tx returns it). */
static int hand_back(struct fp_state *st, int kind, const uint8_t *pkt, int len)
{
    flush(st);
    st->slow_kind = kind;
    st->slow_len = len < SLOW_MAX ? len : SLOW_MAX;
    memcpy(st->slow, pkt, (size_t)st->slow_len);
    return 1;
}

/* Read one packet from the TUN into segment slots at o: the first hl + gso bytes (headers and
 * the first payload) in slot 0, then gso payload bytes into each later slot behind room for its
 * header, the rest (a packet of another geometry) into st->ovf.  A super-packet of the slots'
 * geometry is then segmented where it lies; anything else is gathered (see gather). */
static ssize_t read_slots(struct fp_state *st, uint8_t *o, int *nv)
{
    int hl = st->geo_hl, gso = st->geo_gso, stride = hl + gso;
    int rows = (0xFFFF - hl) / gso + 2;
    struct iovec *iov = st->tiov;
    iov[0].iov_base = st->in;
    iov[0].iov_len = VNET_LEN;
    iov[1].iov_base = o;
    iov[1].iov_len = (size_t)stride;
    for (int r = 1; r < rows; r++) {
        iov[1 + r].iov_base = o + (size_t)r * (size_t)stride + (size_t)hl;
        iov[1 + r].iov_len = (size_t)gso;
    }
    iov[rows + 1].iov_base = st->ovf;
    iov[rows + 1].iov_len = IN_SIZE;
    *nv = rows + 2;
    return readv(st->tun_fd, iov, rows + 2);
}

/* Copy the len packet bytes read_slots scattered over its iovecs to st->in + VNET_LEN (len is
 * at most IN_SIZE - VNET_LEN: fp_tx drops longer reads). */
static uint8_t *gather(struct fp_state *st, int nv, int len)
{
    uint8_t *p = st->in + VNET_LEN;
    int pos = 0;
    for (int i = 1; i < nv && pos < len; i++) {
        int take = (int)st->tiov[i].iov_len < len - pos ? (int)st->tiov[i].iov_len : len - pos;
        memcpy(p + pos, st->tiov[i].iov_base, (size_t)take);
        pos += take;
    }
    return p;
}

/* Drain up to budget reads from the TUN.  Returns 0 when done (drained or budget spent), 1 when
 * a packet waits in st->slow for an ICMP error (call again after), -1 on a read error (errno). */
static int fp_tx(struct fp_state *st, int budget)
{
    int rc = 0, batched = 0;
    st->slow_kind = SLOW_NONE;
    if (st->ptb_len)   /* kept by the flush of an earlier hand-back */
        return hand_back_too_big(st);
    st->out_used = 0;   /* every earlier call ended with a flush */
    if (st->geo_gso < MIN_SLOT_GSO) {  /* first call: IPv4 + TCP with timestamps at the MTU */
        st->geo_hl = 52;
        st->geo_gso = st->mtu - 52 >= MIN_SLOT_GSO ? st->mtu - 52 : MIN_SLOT_GSO;
    }
    for (int k = 0; k < budget; k++) {
        if (st->out_used > OUT_FLUSH) {
            flush(st);
            st->out_used = 0;
        }
        uint8_t *o = st->out + st->out_used;
        int nv;
        ssize_t n = read_slots(st, o, &nv);
        if (n < 0) {
            if (errno == EINTR) {
                k--;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                rc = -1;
            break;
        }
        st->counters[C_TUN_READS]++;
        int len = (int)n - VNET_LEN;
        const uint8_t *v = st->in;
        int stride = st->geo_hl + st->geo_gso;
        /* The packet: contiguous at o when it fits slot 0, else gathered (copied) to st->in. */
        uint8_t *p = len <= stride ? o : NULL;
        int version = o[0] >> 4;
        /* Longer than st->in holds after the header (gather copies there): longer than an
         * IPv4 packet or an IPv6 one without a jumbo payload can be, and than a stock TUN
         * reads -- but a BIG TCP super-packet is, and the slots and st->ovf take more. */
        if (len < 20 || len > IN_SIZE - VNET_LEN || (version == 6 && len < 40)) {
            st->counters[D_MALFORMED]++;
            continue;
        }
        uint32_t peer;
        if (version == 4) {
            uint32_t dst;
            memcpy(&dst, o + 16, 4);
            peer = lookup(st, dst);
        } else if (version == 6 && st->ipv6) {
            peer = lookup6(st, o + 24);
        } else {
            st->counters[D_NOT_IPV4]++;   /* not IP, or IPv6 where the backend carries IPv4 only (ipip) */
            continue;
        }
        if (!peer) {
            st->counters[D_NO_ROUTE]++;
            if (!icmp_allowed(st))
                continue;
            return hand_back(st, SLOW_NET_UNREACHABLE, p ? p : gather(st, nv, len), len);
        }
        int gso_type = v[1] & 0x7F;
        int gso_size = v[4] | v[5] << 8;
        int hop_at = version == 6 ? 7 : 8;   /* IPv6's hop limit, IPv4's TTL */
        if (gso_type == (version == 6 ? VNET_GSO_TCPV6 : VNET_GSO_TCPV4)) {
            int seglen, total, ihl, thl;
            if (!p)
                p = o;   /* the headers are in slot 0 either way */
            if (tcp_headers(p, len, version == 6, &ihl, &thl) || gso_size <= 0) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            int hl = ihl + thl;
            if (hl + gso_size > st->mtu) {
                st->counters[D_MTU] += (uint64_t)((len - hl + gso_size - 1) / gso_size);
                continue;
            }
            int capacity = stride + (nv - 3) * st->geo_gso;   /* bytes the slots hold */
            int count;
            if (hl == st->geo_hl && gso_size == st->geo_gso && len <= capacity) {
                count = segment(o, len, ihl, thl, version == 6, o + hl, stride, gso_size, o,
                                OUT_SIZE - st->out_used, st->ttl_decrement, &seglen, &total);
            } else {
                p = gather(st, nv, len);
                count = segment(p, len, ihl, thl, version == 6, p + hl, gso_size, gso_size, o,
                                OUT_SIZE - st->out_used, st->ttl_decrement, &seglen, &total);
                if (gso_size >= MIN_SLOT_GSO && hl <= 120) {   /* the next ones are likely alike */
                    st->geo_hl = hl;
                    st->geo_gso = gso_size;
                }
            }
            if (count == -2) {
                st->counters[D_TTL_EXCEEDED]++;
                if (!icmp_allowed(st))
                    continue;
                return hand_back(st, SLOW_TIME_EXCEEDED, len > stride && p == o ? gather(st, nv, len) : p, len);
            }
            if (count < 0) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            st->out_used += total;
            st->counters[C_TSO_FRAMES]++;
            st->counters[C_TSO_SEGMENTS] += (uint64_t)count;
            batched = 1;
            queue_segments(st, peer, o, count, seglen, total);
            continue;
        }
        if (gso_type != VNET_GSO_NONE) {
            st->counters[D_MALFORMED]++;   /* GSO kinds we never enable (UDP), or not the packet's family */
            continue;
        }
        if (len > st->mtu) {
            st->counters[D_MTU]++;
            continue;
        }
        if (!p)
            memcpy(o, gather(st, nv, len), (size_t)len);
        if (v[0] & VNET_F_NEEDS_CSUM) {
            int cs = v[6] | v[7] << 8, co = v[8] | v[9] << 8;
            if (cs < (version == 6 ? 40 : 20) || cs + co + 2 > len) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            uint16_t sum = (uint16_t)~fold(sum_bytes(o + cs, (size_t)(len - cs), 0));
            if (sum == 0 && o[version == 6 ? 6 : 9] == IPPROTO_UDP)
                sum = 0xFFFF;   /* RFC 768; RFC 8200 section 8.1 */
            memcpy(o + cs + co, &sum, 2);
        }
        if (st->ttl_decrement) {
            if (o[hop_at] <= 1) {
                st->counters[D_TTL_EXCEEDED]++;
                if (!icmp_allowed(st))
                    continue;
                return hand_back(st, SLOW_TIME_EXCEEDED, o, len);
            }
            if (version == 6)
                o[7] -= 1;   /* no header checksum */
            else
                decrement_ttl(o);
        }
        st->out_used += len;
        queue_segments(st, peer, o, 1, len, len);
    }
    flush(st);
    if (batched)
        st->counters[C_TSO_BATCHES]++;
    if (rc == 0 && st->ptb_len)
        return hand_back_too_big(st);
    return rc;
}

/* -- receive ----------------------------------------------------------------------------------------- */

static const uint8_t VNET_NONE[VNET_LEN];

static void tun_write(struct fp_state *st, struct iovec *iov, int n)
{
    while (writev(st->tun_fd, iov, n) < 0) {
        if (errno == EINTR)
            continue;
        st->counters[D_TUN_WRITE_ERROR]++;
        return;
    }
    st->counters[C_TUN_WRITES]++;
}

static void write_single(struct fp_state *st, uint8_t *p, int len)
{
    struct iovec iov[2] = {{(void *)VNET_NONE, VNET_LEN}, {p, (size_t)len}};
    tun_write(st, iov, 2);
}

/* Could this packet be part of a GRO run (tcp_gro_receive's conditions)?  Its IP header length
 * (20: IPv4 without options or fragments; 40: IPv6 whose next header is TCP) and in *hlp the
 * length of its headers, or 0. */
static inline int mergeable(const uint8_t *p, int len, int *hlp)
{
    int ihl;
    if (len < 40)
        return 0;
    if (p[0] == 0x45 && p[9] == IPPROTO_TCP && !(p[6] & 0x3F) && !p[7])
        ihl = 20;
    else if (p[0] >> 4 == 6 && p[6] == IPPROTO_TCP && len >= 60)
        ihl = 40;
    else
        return 0;
    int hl = ihl + ((p[ihl + 12] >> 4) << 2);
    if (hl < ihl + 20 || hl >= len || (p[ihl + 13] & ~TCP_PSH) != TCP_ACK)
        return 0;
    *hlp = hl;
    return ihl;
}

/* Do the checksums of the TCP packet p (len bytes, IP header ihl: 20 or 40) verify: IPv4's header
 * checksum, and the TCP checksum over the pseudo header and the segment (RFC 9293 section 3.1;
 * RFC 8200 section 8.1)?  The pseudo header's addresses are the bytes just before the TCP header
 * (IPv4 12..20, IPv6 8..40), so one sum from there covers them and the segment.  tcp4_gro_receive
 * and tcp6_gro_receive validate (skb_gro_checksum_validate) before merging: the merged packet
 * leaves with a fresh checksum to complete, and flannel's outer IPv4 UDP checksum is 0, so
 * nothing else would notice a segment corrupted on the way. */
static inline int csum_ok(const uint8_t *p, int len, int ihl)
{
    if (ihl == 20 && fold(sum_bytes(p, 20, 0)) != 0xFFFF)
        return 0;
    int from = ihl == 20 ? 12 : 8;
    uint64_t s = sum_bytes(p + from, (size_t)(len - from), htons(IPPROTO_TCP) + htons((uint16_t)(len - ihl)));
    return fold(s) == 0xFFFF;
}

/* Headers equal but for the IP length (IPv4 total, IPv6 payload), IPv4 ID and checksum, sequence
 * number, PSH and TCP checksum. */
static inline int same_flow(const uint8_t *a, const uint8_t *b, int ihl, int hl)
{
    int ip = ihl == 20 ? a[0] == b[0] && a[1] == b[1] && !memcmp(a + 6, b + 6, 4) && !memcmp(a + 12, b + 12, 8)
                       : !memcmp(a, b, 4) && !memcmp(a + 6, b + 6, 34);
    const uint8_t *t = a + ihl, *u = b + ihl;
    return ip && !memcmp(t, u, 4) && !memcmp(t + 8, u + 8, 5) && (t[13] & ~TCP_PSH) == (u[13] & ~TCP_PSH)
           && t[14] == u[14] && t[15] == u[15] && !memcmp(t + 18, u + 18, (size_t)(hl - ihl - 18));
}

/* Write pkts[0..k) to the TUN, merging runs of one TCP flow into super-packets. */
static void coalesce(struct fp_state *st, uint8_t **pkts, int *lens, int k)
{
    uint8_t head[VNET_LEN + 128];
    struct iovec iov[MAX_RUN + 1];
    int i = 0;
    while (i < k) {
        uint8_t *p = pkts[i];
        int len = lens[i];
        int hl, ihl = mergeable(p, len, &hl);
        if (!ihl) {
            write_single(st, p, len);
            i++;
            continue;
        }
        if (!csum_ok(p, len, ihl)) {
            /* As it came, claiming nothing (flags 0): the pod's stack checks it, drops it and
             * counts it (TcpInCsumErrors). */
            st->counters[C_RX_CSUM_ERRORS]++;
            write_single(st, p, len);
            i++;
            continue;
        }
        int mss = len - hl;
        int total = len;
        int psh = p[ihl + 13] & TCP_PSH;
        uint32_t next = get32(p + ihl + 4) + (uint32_t)mss;
        int cap = (MAX_IP_TOTAL - hl) / mss;
        if (cap > MAX_RUN)
            cap = MAX_RUN;
        int j = i + 1;
        int open = !psh;
        while (open && j < k && j - i < cap) {
            uint8_t *q = pkts[j];
            int ql = lens[j], qhl;
            if (mergeable(q, ql, &qhl) != ihl || qhl != hl || ql - hl > mss || get32(q + ihl + 4) != next
                || !same_flow(p, q, ihl, hl) || !csum_ok(q, ql, ihl))
                break;   /* q starts the next round (a failing one goes alone, counted) */
            next += (uint32_t)(ql - hl);
            total += ql - hl;
            if (q[ihl + 13] & TCP_PSH) {
                psh = 1;
                open = 0;
            }
            if (ql - hl < mss)
                open = 0;
            j++;
        }
        if (j - i == 1) {
            write_single(st, p, len);
            i++;
            continue;
        }
        uint8_t *h = head + VNET_LEN;
        memcpy(h, p, (size_t)hl);
        if (ihl == 20) {
            put16(h + 2, (uint16_t)total);
            ip_checksum(h, 20);
        } else {
            put16(h + 4, (uint16_t)(total - 40));   /* RFC 8200: payload length, no header checksum */
        }
        if (psh)
            h[ihl + 13] |= TCP_PSH;
        uint16_t ps = fold(pseudo_sum(h, ihl, IPPROTO_TCP, (uint32_t)(total - ihl)));
        memcpy(h + ihl + 16, &ps, 2);
        head[0] = VNET_F_NEEDS_CSUM;
        head[1] = ihl == 20 ? VNET_GSO_TCPV4 : VNET_GSO_TCPV6;
        head[2] = hl & 0xFF; head[3] = hl >> 8;
        head[4] = mss & 0xFF; head[5] = mss >> 8;
        head[6] = (uint8_t)ihl; head[7] = 0;
        head[8] = 16; head[9] = 0;
        /* The patched header, then every payload where it was received. */
        iov[0].iov_base = head;
        iov[0].iov_len = (size_t)(VNET_LEN + hl);
        iov[1].iov_base = p + hl;
        iov[1].iov_len = (size_t)mss;
        int n = 2;
        for (int m = i + 1; m < j; m++) {
            iov[n].iov_base = pkts[m] + hl;
            iov[n].iov_len = (size_t)(lens[m] - hl);
            n++;
        }
        tun_write(st, iov, n);
        st->counters[C_COALESCED] += (uint64_t)(j - i);
        i = j;
    }
}

/* Is this an inner packet we may write: IPv4 with a total length equal to its length and a
 * header (IHL, 20 to 60 bytes) within it, or (with ipv6) IPv6 whose payload length and header
 * are its length? */
static inline int inner_ok(const uint8_t *p, int len, int ipv6)
{
    if (len >= 20 && p[0] >> 4 == 4) {
        int ihl = (p[0] & 0x0F) << 2;
        return ihl >= 20 && ihl <= len && get16(p + 2) == len;
    }
    return ipv6 && len >= 40 && p[0] >> 4 == 6 && get16(p + 4) + 40 == len;
}

/* Received inner packets wait in st->rx (and in pkts/lens) until the socket is drained, the
 * budget is spent or the area is full, and are then merged and written in one go: a flow's run
 * goes on across reads (a 64 KB super-packet arrives as two UDP GSO datagrams: 65507 bytes is
 * the most one can carry). */
struct pending { uint8_t *pkts[MAX_PENDING]; int lens[MAX_PENDING]; int k; size_t used; };

static void write_pending(struct fp_state *st, struct pending *pd)
{
    if (pd->k > 1)
        st->counters[C_COALESCED_BATCHES]++;
    coalesce(st, pd->pkts, pd->lens, pd->k);
    pd->k = 0;
    pd->used = 0;
}

static int rx_udp(struct fp_state *st, int budget)
{
    struct pending pd = {.k = 0, .used = 0};
    char control[CMSG_SPACE(sizeof(int))];
    int rc = 0;
    for (int k = 0; k < budget; k++) {
        if (pd.used + RX_UDP_SIZE > RX_AREA || pd.k + MAX_GRO_SEGMENTS > MAX_PENDING)
            write_pending(st, &pd);
        uint8_t *buf = st->rx + pd.used;
        struct sockaddr_in from;
        struct iovec iov = {buf, RX_UDP_SIZE};
        struct msghdr msg = {.msg_name = &from, .msg_namelen = sizeof(from), .msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = control, .msg_controllen = sizeof(control)};
        ssize_t n = recvmsg(st->sock_fd, &msg, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) {
                k--;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                rc = -1;
            break;
        }
        st->counters[C_RX_SYSCALLS]++;
        int seg = (int)n;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_UDP_ && c->cmsg_type == UDP_GRO_) {
                int g;
                memcpy(&g, CMSG_DATA(c), sizeof(g));
                if (g > 0)
                    seg = g;
            }
        }
        if (seg <= 0)
            seg = 1;
        int count = n ? (int)((n + seg - 1) / seg) : 1;
        /* A member's worker sends from udp_port, which no other user of that node can bind
         * while the worker holds it: another source port is another process (udp.py). */
        if (from.sin_port != st->port || !is_member(st, from.sin_addr.s_addr)) {
            st->counters[D_NON_MEMBER] += (uint64_t)count;
            continue;
        }
        if (n == 0) {                  /* an empty datagram carries no packet */
            st->counters[D_MALFORMED]++;
            continue;
        }
        if ((msg.msg_flags & MSG_TRUNC) || count > MAX_GRO_SEGMENTS) {
            st->counters[D_MALFORMED] += (uint64_t)count;
            continue;
        }
        int good = 0;
        for (int off = 0; off < n; off += seg) {
            int len = off + seg <= n ? seg : (int)n - off;
            uint8_t *p = buf + off;
            if (!inner_ok(p, len, st->ipv6)) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            if (!source_ok(st, p, from.sin_addr.s_addr)) {
                st->counters[D_SPOOFED]++;
                continue;
            }
            pd.pkts[pd.k] = p;
            pd.lens[pd.k++] = len;
            good++;
        }
        pd.used += ((size_t)n + 63) & ~(size_t)63;
        st->counters[C_RX_PACKETS] += (uint64_t)good;
        st->counters[C_RX_BYTES] += (uint64_t)n;
    }
    write_pending(st, &pd);
    return rc;
}

/* One ipip receive slot: an underlay packet of the TUN's MTU with the largest outer header (60
 * bytes) and then some, at least RX_SLOT -- a jumbo-frame underlay's packets are not cut.  As
 * ipip.py's rx_slot. */
static int rx_slot(int mtu)
{
    int slot = (mtu + 60 + 64) & ~63;
    return slot < RX_SLOT ? RX_SLOT : slot;
}

static int rx_ipip(struct fp_state *st, int budget)
{
    struct pending pd = {.k = 0, .used = 0};
    int rc = 0;
    const int slot = rx_slot(st->mtu);
    const int slots = RX_AREA / slot < RX_SLOTS ? RX_AREA / slot : RX_SLOTS;
    for (int k = 0; k < budget; k++) {
        if (pd.used + (size_t)slots * slot > RX_AREA || pd.k + slots > MAX_PENDING)
            write_pending(st, &pd);
        uint8_t *base = st->rx + pd.used;
        for (int i = 0; i < slots; i++) {
            struct msghdr *h = &st->rmsgs[i].msg_hdr;
            st->riovs[i].iov_base = base + i * slot;
            st->riovs[i].iov_len = (size_t)slot;
            h->msg_name = &st->rnames[i];
            h->msg_namelen = sizeof(struct sockaddr_in);
            h->msg_iov = &st->riovs[i];
            h->msg_iovlen = 1;
            h->msg_control = NULL;
            h->msg_controllen = 0;
            h->msg_flags = 0;
        }
        int got = recvmmsg(st->sock_fd, st->rmsgs, (unsigned)slots, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EINTR) {
                k--;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                rc = -1;
            break;
        }
        st->counters[C_RX_SYSCALLS]++;
        int good = 0;
        for (int i = 0; i < got; i++) {
            uint8_t *o = base + i * slot;
            int n = (int)st->rmsgs[i].msg_len;
            if (n < 20 || (st->rmsgs[i].msg_hdr.msg_flags & MSG_TRUNC)) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            uint32_t src;
            memcpy(&src, o + 12, 4);
            if (!is_member(st, src)) {
                st->counters[D_NON_MEMBER]++;
                continue;
            }
            int ihl = (o[0] & 0x0F) << 2;
            if (o[0] >> 4 != 4 || ihl < 20 || ihl > n || o[9] != 4 || !inner_ok(o + ihl, n - ihl, 0)) {
                st->counters[D_MALFORMED]++;
                continue;
            }
            if (!source_ok(st, o + ihl, src)) {
                st->counters[D_SPOOFED]++;
                continue;
            }
            pd.pkts[pd.k] = o + ihl;
            pd.lens[pd.k++] = n - ihl;
            st->counters[C_RX_BYTES] += (uint64_t)(n - ihl);
            good++;
        }
        pd.used += (size_t)got * slot;
        st->counters[C_RX_PACKETS] += (uint64_t)good;
        if (got < slots)
            break;
    }
    write_pending(st, &pd);
    return rc;
}

/* The receive side's last step on k inner packets laid back to back in buf (lens[i] bytes each):
 * checked as received packets are, then merged and written to st->tun_fd (tests: a
 * SOCK_SEQPACKET socket keeps the writes apart). */
int fp_write_packets(struct fp_state *st, uint8_t *buf, const int *lens, int k)
{
    uint8_t *pkts[MAX_PENDING];
    int ls[MAX_PENDING], k2 = 0;
    if (k > MAX_PENDING)
        return -1;
    for (int i = 0; i < k; i++) {
        if (inner_ok(buf, lens[i], st->ipv6)) {
            pkts[k2] = buf;
            ls[k2++] = lens[i];
        } else {
            st->counters[D_MALFORMED]++;
        }
        buf += lens[i];
    }
    coalesce(st, pkts, ls, k2);
    return k2;
}

/* Drain up to budget reads from the underlay socket into the TUN.  0, or -1 on error (errno). */
static int fp_rx(struct fp_state *st, int budget)
{
    return st->kind == KIND_UDP ? rx_udp(st, budget) : rx_ipip(st, budget);
}

/* -- the worker's loop ------------------------------------------------------------------------------ */

#define MAX_OTHER_FDS 64

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait on the TUN, the underlay socket and Python's other fds (control sockets) and move
 * packets until Python is needed: returns 0 when one of the other fds is readable or
 * timeout_ms have passed (busy or not), 1 when a packet waits in st->slow for an ICMP error,
 * 2 when a signal interrupted the wait, -1 on an error (errno). */
int fp_run(struct fp_state *st, const int *other, int n_other, int timeout_ms)
{
    struct pollfd pfd[2 + MAX_OTHER_FDS];
    if (st->ptb_len) {   /* kept by the flush of the last hand-back: told now, not at the next read */
        st->slow_kind = SLOW_NONE;
        return hand_back_too_big(st);
    }
    if (n_other > MAX_OTHER_FDS)
        n_other = MAX_OTHER_FDS;
    pfd[0].fd = st->tun_fd;
    pfd[1].fd = st->sock_fd;
    for (int i = 0; i < n_other; i++)
        pfd[2 + i].fd = other[i];
    for (int i = 0; i < 2 + n_other; i++)
        pfd[i].events = POLLIN;
    int64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        int wait = (int)(deadline - now_ms());
        if (wait < 0)
            return 0;
        int r = poll(pfd, (nfds_t)(2 + n_other), wait);
        if (r < 0)
            return errno == EINTR ? 2 : -1;
        if (r == 0)
            return 0;
        if (pfd[0].revents) {
            int rc = fp_tx(st, 64);
            if (rc)
                return rc;
        }
        if (pfd[1].revents) {
            int rc = fp_rx(st, 64);
            if (rc)
                return rc;
        }
        for (int i = 0; i < n_other; i++)
            if (pfd[2 + i].revents)
                return 0;
    }
}

/* -- a module so that setuptools builds and installs this file; Python uses it through ctypes ---- */

static struct PyModuleDef fastpath_module = {PyModuleDef_HEAD_INIT, "_fastpath",
                                             "agentd data-plane fast path (C functions, used through ctypes)", -1,
                                             NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&fastpath_module); }
