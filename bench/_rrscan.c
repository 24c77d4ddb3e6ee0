/* The receive path of bench/_rrsim.py (the route-reflector client simulator): walk whole BGP
 * messages in a buffer, count UPDATEs and KEEPALIVEs, and keep one client's set of held
 * prefixes as a bitmap -- without decoding anything but lengths and NLRI (RFC 4271 §4.1,
 * §4.3; MP_REACH/MP_UNREACH for IPv4 unicast, RFC 4760 §3-4).
 *
 * The simulated clients announce prefix i as BASE + i * 64 / 26; bit i of the bitmap says
 * the client holds it.  Any other prefix is counted as foreign, the client's own one as own.
 * bench/_rrscan.py holds the Python reference of exactly this function; tests/unit/bench/
 * keeps the two equal.  Built on the fly by bench/_rrscan.py (cc -O2 -shared).
 *
 *   long rr_scan(buf, len, bitmap, nbits, base, own, ctr)
 *
 * returns the bytes consumed: a run of whole, well-formed UPDATE and KEEPALIVE messages.
 * It stops before a partial message, before any other message type (OPEN, NOTIFICATION,
 * ROUTE-REFRESH: the caller handles those) and before a malformed message (the caller
 * finds out why).
 */
#define _GNU_SOURCE
#include <stdint.h>

enum {
    C_UPDATES,    /* UPDATE messages */
    C_KEEPALIVES, /* KEEPALIVE messages */
    C_ANNOUNCED,  /* NLRI entries of our prefixes (own and others) */
    C_WITHDRAWN,  /* withdrawn entries of our prefixes */
    C_HELD,       /* bits set now: prefixes of other clients held */
    C_FOREIGN,    /* NLRI or withdrawn entries that are no client's /26 */
    C_EOR,        /* End-of-RIB markers (RFC 4724 §2) */
    C_OWN,        /* entries for the client's own prefix (reflected back to it) */
    C_BYTES,      /* bytes of the messages consumed */
};

/* 1 when p[0:n] is a well-formed list of IPv4 prefixes (length octet <= 32, then its octets). */
static int valid(const uint8_t *p, long n)
{
    long i = 0;
    while (i < n) {
        if (p[i] > 32)
            return 0;
        i += 1 + (p[i] + 7) / 8;
    }
    return i == n;
}

/* Apply a valid prefix list: announce (1) sets bits, withdraw (0) clears them. */
static void apply(const uint8_t *p, long n, uint8_t *bitmap, long nbits, uint32_t base, long own, int64_t *ctr,
                  int announce)
{
    long i = 0;
    while (i < n) {
        unsigned plen = p[i];
        long octets = (plen + 7) / 8;
        uint32_t addr = 0;
        for (long k = 0; k < octets; k++)
            addr |= (uint32_t)p[i + 1 + k] << (24 - 8 * k);
        uint32_t off = addr - base;
        if (plen == 26 && addr >= base && (off & 63) == 0 && (long)(off >> 6) < nbits) {
            long idx = off >> 6;
            if (idx == own) {
                ctr[C_OWN]++;
            } else {
                uint8_t bit = (uint8_t)(1u << (idx & 7));
                if (announce) {
                    ctr[C_ANNOUNCED]++;
                    if (!(bitmap[idx >> 3] & bit)) {
                        bitmap[idx >> 3] |= bit;
                        ctr[C_HELD]++;
                    }
                } else {
                    ctr[C_WITHDRAWN]++;
                    if (bitmap[idx >> 3] & bit) {
                        bitmap[idx >> 3] &= (uint8_t)~bit;
                        ctr[C_HELD]--;
                    }
                }
            }
        } else {
            ctr[C_FOREIGN]++;
        }
        i += 1 + octets;
    }
}

/* One UPDATE body; 0 when malformed (nothing is counted then: the caller reports it). */
static int update(const uint8_t *b, long n, uint8_t *bitmap, long nbits, uint32_t base, long own, int64_t *ctr)
{
    if (n < 4)
        return 0;
    long wlen = (b[0] << 8) | b[1];
    if (2 + wlen + 2 > n)
        return 0;
    const uint8_t *w = b + 2;
    long alen = (b[2 + wlen] << 8) | b[3 + wlen];
    const uint8_t *a = b + 4 + wlen;
    if (4 + wlen + alen > n)
        return 0;
    const uint8_t *nlri = a + alen;
    long nlen = n - 4 - wlen - alen;

    /* Check every length before touching a bitmap, so a malformed UPDATE changes nothing. */
    const uint8_t *mp_reach = 0, *mp_unreach = 0;
    long mp_reach_len = 0, mp_unreach_len = 0;
    int other_attrs = 0, mp_unreach_v4 = 0;
    long i = 0;
    while (i < alen) {
        if (i + 3 > alen)
            return 0;
        uint8_t flags = a[i], code = a[i + 1];
        long vlen, hdr;
        if (flags & 0x10) {
            if (i + 4 > alen)
                return 0;
            vlen = (a[i + 2] << 8) | a[i + 3];
            hdr = 4;
        } else {
            vlen = a[i + 2];
            hdr = 3;
        }
        if (i + hdr + vlen > alen)
            return 0;
        const uint8_t *v = a + i + hdr;
        if (code == 14 || code == 15) {
            if (vlen < 3)
                return 0;
            int v4 = ((v[0] << 8) | v[1]) == 1 && v[2] == 1;
            if (code == 14) {
                if (vlen < 5 || 4 + v[3] + 1 > vlen)
                    return 0;
                if (v4) {
                    mp_reach = v + 5 + v[3];
                    mp_reach_len = vlen - 5 - v[3];
                }
                other_attrs = 1;
            } else if (v4) {
                mp_unreach = v + 3;
                mp_unreach_len = vlen - 3;
                mp_unreach_v4 = 1;
            } else {
                other_attrs = 1;
            }
        } else {
            other_attrs = 1;
        }
        i += hdr + vlen;
    }
    if (!valid(w, wlen) || !valid(nlri, nlen) || (mp_unreach && !valid(mp_unreach, mp_unreach_len)) ||
        (mp_reach && !valid(mp_reach, mp_reach_len)))
        return 0;
    /* Withdrawn before announced, as a receiver applies them (RFC 4271 §9 / RFC 4760 §5). */
    apply(w, wlen, bitmap, nbits, base, own, ctr, 0);
    if (mp_unreach)
        apply(mp_unreach, mp_unreach_len, bitmap, nbits, base, own, ctr, 0);
    apply(nlri, nlen, bitmap, nbits, base, own, ctr, 1);
    if (mp_reach)
        apply(mp_reach, mp_reach_len, bitmap, nbits, base, own, ctr, 1);
    if (wlen == 0 && nlen == 0 && (alen == 0 || (mp_unreach_v4 && mp_unreach_len == 0 && !other_attrs)))
        ctr[C_EOR]++;
    ctr[C_UPDATES]++;
    return 1;
}

long rr_scan(const uint8_t *buf, long len, uint8_t *bitmap, long nbits, uint32_t base, long own, int64_t *ctr)
{
    long pos = 0;
    while (len - pos >= 19) {
        const uint8_t *m = buf + pos;
        for (int k = 0; k < 16; k++)
            if (m[k] != 0xff)
                return pos;
        long mlen = (m[16] << 8) | m[17];
        if (mlen < 19 || mlen > 4096 || mlen > len - pos)
            return pos;
        if (m[18] == 4) {
            if (mlen != 19)
                return pos;
            ctr[C_KEEPALIVES]++;
        } else if (m[18] == 2) {
            if (!update(m + 19, mlen - 19, bitmap, nbits, base, own, ctr))
                return pos;
        } else {
            return pos;
        }
        ctr[C_BYTES] += mlen;
        pos += mlen;
    }
    return pos;
}

/* ------------------------------------------------------------------ the receive pump
 *
 * rr_pump reads every ready socket of an epoll set of Established clients and scans what
 * arrived, all in C, so the simulator's Python runs only for what is rare (an OPEN,
 * NOTIFICATION or ROUTE-REFRESH, a closed or failed connection, a malformed message).
 * The epoll set holds client sockets only (registered by Python with data.fd = the fd).
 */
#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

#define LEFTOVER 4096

struct rr_client {
    int64_t ctr[9];
    int64_t target; /* prefixes the client must hold for the phase to be done; -1: none */
    double last_rx; /* CLOCK_MONOTONIC of the last receive */
    double max_gap; /* longest time between two receives */
    int32_t own;    /* the client's index: its own prefix */
    int32_t done;   /* held == target */
    int32_t left;   /* bytes of a partial message kept in leftover */
    int32_t pad;
    uint8_t leftover[LEFTOVER];
};

struct rr_state {
    int64_t nbits;
    int64_t base;
    uint8_t *bitmaps; /* client i: bitmaps + i * stride */
    int64_t stride;
    struct rr_client *clients;
    int32_t *fd2idx; /* fd -> client index, -1 for none */
    int64_t nfds;
    uint8_t *rbuf;
    int64_t rbuf_size; /* at least LEFTOVER + the most one recv takes */
    int64_t recv_max;
    int64_t done_count; /* clients with done set */
    int64_t want_done;  /* done_count that completes the phase (0: no phase) */
    double t_done;      /* when done_count first reached want_done; 0 before */
    double last_update; /* the last receive that carried an UPDATE */
    int64_t recvs;      /* recv calls */
    /* the event that made rr_pump return 1 */
    int64_t ev_client;
    int64_t ev_kind; /* 1: rbuf[ev_pos:ev_len] starts with a message for Python; 2: closed; 3: error */
    int64_t ev_pos;
    int64_t ev_len;
    int64_t ev_errno;
};

static double mono(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Read and scan one client's socket.  0: fine, 1: an event for Python (recorded in st). */
static int pump_one(struct rr_state *st, int fd, long idx)
{
    struct rr_client *c = &st->clients[idx];
    uint8_t *buf = st->rbuf;
    long left = c->left;
    if (left)
        memcpy(buf, c->leftover, (size_t)left);
    long room = st->rbuf_size - left;
    if (room > st->recv_max)
        room = st->recv_max;
    ssize_t n = recv(fd, buf + left, (size_t)room, MSG_DONTWAIT);
    st->recvs++;
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return 0;
        st->ev_client = idx;
        st->ev_kind = 3;
        st->ev_errno = errno;
        return 1;
    }
    if (n == 0) {
        st->ev_client = idx;
        st->ev_kind = 2;
        return 1;
    }
    double now = mono();
    if (now - c->last_rx > c->max_gap)
        c->max_gap = now - c->last_rx;
    c->last_rx = now;
    long total = left + n;
    int64_t updates0 = c->ctr[C_UPDATES];
    long pos = rr_scan(buf, total, st->bitmaps + idx * st->stride, st->nbits, (uint32_t)st->base, c->own, c->ctr);
    c->left = 0;
    if (c->ctr[C_UPDATES] != updates0) {
        st->last_update = now;
        if (c->target >= 0) {
            int done = c->ctr[C_HELD] == c->target;
            if (done != c->done) {
                c->done = done;
                st->done_count += done ? 1 : -1;
                if (done && st->want_done && st->done_count == st->want_done && st->t_done == 0)
                    st->t_done = now;
            }
        }
    }
    if (total - pos >= 19) {
        long mlen = (buf[pos + 16] << 8) | buf[pos + 17];
        if (mlen < 19 || mlen > 4096 || mlen <= total - pos) {
            /* a whole message the scan left (or a bad header): Python decides */
            st->ev_client = idx;
            st->ev_kind = 1;
            st->ev_pos = pos;
            st->ev_len = total;
            return 1;
        }
    }
    /* a partial message: keep it for the next receive (it is shorter than 4096 bytes) */
    c->left = (int32_t)(total - pos);
    memcpy(c->leftover, buf + pos, (size_t)c->left);
    return 0;
}

/* Serve ready sockets for up to budget seconds, or until nothing is ready.
 * Returns 0, or 1 with an event in st (the other ready sockets stay ready: epoll is
 * level-triggered, the next call serves them). */
long rr_pump(struct rr_state *st, int epfd, double budget)
{
    struct epoll_event ev[256];
    double end = mono() + budget;
    for (;;) {
        int n = epoll_wait(epfd, ev, 256, 0);
        if (n <= 0)
            return 0;
        for (int i = 0; i < n; i++) {
            int fd = ev[i].data.fd;
            if (fd < 0 || fd >= st->nfds || st->fd2idx[fd] < 0)
                continue;
            if (pump_one(st, fd, st->fd2idx[fd]))
                return 1;
        }
        if (mono() >= end)
            return 0;
    }
}
