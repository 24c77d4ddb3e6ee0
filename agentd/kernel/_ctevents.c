/* agentd conntrack events: the flow recorder's per-event loop in C (a CPython extension).
 *
 * A node's agent hears two conntrack events per pod connection (NEW, DESTROY) over ctnetlink.
 * In Python each cost more than the rest of the agent's work on it; here a read of the socket
 * (recvmmsg, up to BATCH datagrams a system call) and the reading of its events happen in one
 * call, and Python gets one list for the lot.  Per event this file does what
 * agentd/flows/recorder.py's Python loop does (that loop stays: the fall-back when this file is
 * not built, and the reference tests/unit/agentd/test_flow_events.py holds this file equal to):
 *
 *   - an IPv4 event laid out as the kernel lays them out (agentd/kernel/netlink_ct.py, "events
 *     at fixed offsets": the attribute headers of both tuples checked against that layout at
 *     once, masked; the layout's masks come from there, through configure()) is read at its
 *     offsets: addresses, protocol, ports (ICMP: type and code), the reply's source;
 *   - its three addresses are named through the recorder's table (a dict of the 4 address
 *     bytes -> identity or None), asking the recorder (``name(address)``) for one not in it;
 *   - an event with no end named and no address in the pods' or the Services' ranges (the
 *     ranges given) is the node's own (etcd, BGP): left out -- as the kernel's socket filter
 *     (netlink_ct.event_filter) leaves it out where that filter is attached;
 *   - a DESTROY of TCP between two pods (when the pod fast path counts what it carries) gets
 *     the fast path's key of the connection (podpath.h struct podflow_key: the lower (address,
 *     port) first), whether its source is the lower end, and conntrack's start and stop stamps,
 *     for the recorder to take what was carried of it;
 *   - every DESTROY gets conntrack's start stamp (what the Services were then names its end:
 *     recorder.py's _services_at), read here rather than by walking the event again in Python.
 *
 * An event is returned as the tuple (datagram, type, source's name, destination's, reply
 * source's, carried, start) where carried is None or (key, source is lower, start ns, stop ns)
 * and start a DESTROY's CTA_TIMESTAMP_START (ns; 0: a NEW, or not kept, or not readable); a
 * datagram laid out otherwise (IPv6, more than one message, a zone, a malformed one) as its bytes,
 * in its place, for Python to read the long way (which counts what is malformed).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define BATCH 64         /* datagrams one recvmmsg takes at most */
#define SLOT 8192        /* bytes of each (an event is a few hundred; a longer one is cut, for Python to refuse) */
#define NLMSG_HDRLEN_ 16
#define BODY (NLMSG_HDRLEN_ + 4) /* the first attribute: after nlmsghdr and nfgenmsg */
#define MSG_NEW_ 0x100   /* NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW */
#define MSG_DELETE_ 0x102
#define AF_INET_ 2
#define TCP 6
#define SERVICES_MAX 16
#define LAYOUT_MAX 256

/* A layout: the bytes at BODY whose (byte & mask) == want. */
struct layout {
	Py_ssize_t len;
	uint8_t mask[LAYOUT_MAX], want[LAYOUT_MAX];
};

static struct layout ports, icmp, lifetime;
static int configured;
static uint8_t *bufs;
static struct mmsghdr msgs[BATCH];
static struct iovec iovs[BATCH];

struct ctx {
	PyObject *names, *name;
	uint32_t services[SERVICES_MAX][2]; /* the ranges (network, mask): the pods' and the Services' */
	int n_services, counting;
};

static int fits(const uint8_t *p, Py_ssize_t n, const struct layout *l)
{
	if (n < l->len)
		return 0;
	for (Py_ssize_t i = 0; i < l->len; i++)
		if ((p[i] & l->mask[i]) != l->want[i])
			return 0;
	return 1;
}

static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static uint64_t be64(const uint8_t *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }
static uint16_t h16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t h32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static int in_ranges(const struct ctx *c, uint32_t a)
{
	for (int i = 0; i < c->n_services; i++)
		if ((a & c->services[i][1]) == c->services[i][0])
			return 1;
	return 0;
}

/* The identity of a 4-byte address (new reference): the table's, else the recorder's answer. */
static PyObject *named(struct ctx *c, const uint8_t *addr)
{
	PyObject *key = PyBytes_FromStringAndSize((const char *)addr, 4), *ident;

	if (!key)
		return NULL;
	ident = PyDict_GetItemWithError(c->names, key);
	if (ident) {
		Py_INCREF(ident);
	} else if (!PyErr_Occurred()) {
		ident = PyObject_CallOneArg(c->name, key);
	}
	Py_DECREF(key);
	return ident;
}

/* CTA_TIMESTAMP's START and STOP, walking the attributes (a DESTROY laid out otherwise) as
 * netlink_ct.lifetime does: 0, or -1 if an attribute does not fit or a stamp is not 8 bytes
 * (malformed: for Python to read and count). */
static int walk_lifetime(const uint8_t *p, Py_ssize_t n, uint64_t *born, uint64_t *died)
{
	Py_ssize_t pos = BODY;

	while (n - pos >= 4) {
		uint16_t len = h16(p + pos), type = h16(p + pos + 2) & 0x3fff;
		if (len < 4 || pos + len > n)
			return -1;
		if (type == 20) { /* CTA_TIMESTAMP */
			Py_ssize_t q = pos + 4, end = pos + len;
			while (end - q >= 4) {
				uint16_t l2 = h16(p + q), t2 = h16(p + q + 2) & 0x3fff;
				if (l2 < 4 || q + l2 > end)
					return -1;
				if (t2 == 1 || t2 == 2) {
					if (l2 != 12)
						return -1;
					*(t2 == 1 ? born : died) = be64(p + q + 4);
				}
				q += (l2 + 3) & ~3;
			}
			return 0;
		}
		pos += (len + 3) & ~3;
	}
	return 0;
}

/* Whether the attributes at p[pos, end) are framed and sized as netlink_ct.decode_event reads
 * them (netlink_ct.rest_ok does the same), ``level`` saying whose they are: 0 the event's own
 * after its tuples (CTA_STATUS, _ID, _TIMEOUT 4 bytes, CTA_TIMESTAMP_EVENT 8, a tuple again not
 * read here, an empty type 3 skipped: a pad), 1 CTA_COUNTERS_* (PACKETS, BYTES 8), 2 CTA_TIMESTAMP (START, STOP 8),
 * 3 CTA_PROTOINFO, 4 CTA_PROTOINFO_TCP (STATE 1).  An event otherwise goes to Python whole,
 * which counts it malformed when it is read, not when (if ever) its record is made. */
static int rest_ok(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, int level)
{
	while (end - pos >= 4) {
		uint16_t len = h16(p + pos), type = h16(p + pos + 2) & 0x3fff;
		Py_ssize_t v = pos + 4, ve = pos + len;
		if (len < 4 || ve > end)
			return 0;
		switch (level) {
		case 0:
			if (type == 1 || type == 2)
				return 0;
			/* An empty type 3: CTA_TIMESTAMP_EVENT's pad (nla_put_be64 with CTA_TIMESTAMP_PAD,
			 * 3, CTA_STATUS's number here) where unaligned 64-bit access is slow; the kernel
			 * never sends an empty CTA_STATUS.  decode_event skips it too. */
			if (type == 3 && len == 4)
				break;
			if ((type == 3 || type == 7 || type == 12) && len != 8)
				return 0;
			if (type == 27 && len != 12)
				return 0;
			if ((type == 9 || type == 10) && !rest_ok(p, v, ve, 1))
				return 0;
			if (type == 20 && !rest_ok(p, v, ve, 2))
				return 0;
			if (type == 4 && !rest_ok(p, v, ve, 3))
				return 0;
			break;
		case 1:
		case 2:
			if ((type == 1 || type == 2) && len != 12)
				return 0;
			break;
		case 3:
			if (type == 1 && !rest_ok(p, v, ve, 4))
				return 0;
			break;
		default:
			if (type == 1 && len != 5)
				return 0;
		}
		pos += (len + 3) & ~3;
	}
	return 1;
}

/* One datagram: a new reference to its item, Py_None (borrowed, not to be kept) if it is the
 * node's own, NULL on error. */
static PyObject *event(struct ctx *c, PyObject *datagram, const uint8_t *p, Py_ssize_t n)
{
	const uint8_t *b = p + BODY, *src, *dst, *rsrc;
	uint16_t mtype, sport, dport;
	uint8_t proto;
	PyObject *n_src = NULL, *n_dst = NULL, *n_rsrc = NULL, *carried = NULL, *item = NULL;
	uint64_t start = 0;

	if (n < BODY || h32(p) != (uint32_t)n)
		goto raw;
	mtype = h16(p + 4);
	if ((mtype != MSG_NEW_ && mtype != MSG_DELETE_) || p[NLMSG_HDRLEN_] != AF_INET_)
		goto raw;
	if (fits(b, n - BODY, &ports)) {
		src = b + 12, dst = b + 20, proto = b[32], sport = be16(b + 40), dport = be16(b + 48), rsrc = b + 64;
		if (!rest_ok(p, BODY + 104, n, 0))
			goto raw;
	} else if (fits(b, n - BODY, &icmp)) {
		src = b + 12, dst = b + 20, proto = b[32], sport = b[48], dport = b[56], rsrc = b + 72;
		if (!rest_ok(p, BODY + 120, n, 0))
			goto raw;
	} else {
		goto raw;
	}
	if (!(n_src = named(c, src)) || !(n_dst = named(c, dst)) || !(n_rsrc = named(c, rsrc)))
		goto out;
	if (n_src == Py_None && n_dst == Py_None && n_rsrc == Py_None &&
	    !in_ranges(c, be32(src)) && !in_ranges(c, be32(dst)) && !in_ranges(c, be32(rsrc))) {
		item = Py_None; /* the node's own traffic: no end in the pods' or Services' ranges */
		goto out;
	}
	if (mtype == MSG_DELETE_ && proto == TCP && c->counting) {
		int t_src = PyObject_IsTrue(n_src), t_dst;
		if (t_src < 0 || (t_dst = PyObject_IsTrue(n_dst)) < 0)
			goto out;
		if (t_src && t_dst) {
			uint8_t key[12];
			uint64_t born = 0, died = 0;
			int lower = memcmp(src, dst, 4) < 0 || (memcmp(src, dst, 4) == 0 && sport <= dport);
			const uint8_t *lo = lower ? src : dst, *hi = lower ? dst : src;
			uint16_t lp = lower ? sport : dport, hp = lower ? dport : sport;
			memcpy(key, lo, 4);
			memcpy(key + 4, hi, 4);
			key[8] = lp >> 8, key[9] = lp & 0xff, key[10] = hp >> 8, key[11] = hp & 0xff;
			if (fits(b, n - BODY, &lifetime)) {
				born = be64(b + 192);
				died = be64(b + 204);
			} else if (walk_lifetime(p, n, &born, &died) < 0) {
				item = datagram; /* malformed: the long way */
				Py_INCREF(item);
				goto out;
			}
			carried = Py_BuildValue("(y#OKK)", key, (Py_ssize_t)12, lower ? Py_True : Py_False,
						(unsigned long long)born, (unsigned long long)died);
			if (!carried)
				goto out;
			start = born;
		}
	}
	if (mtype == MSG_DELETE_ && !carried) {
		uint64_t died = 0;
		if (fits(b, n - BODY, &lifetime))
			start = be64(b + 192);
		else if (walk_lifetime(p, n, &start, &died) < 0)
			start = 0; /* as Python's loop: not known (its record is made the long way) */
	}
	{
		PyObject *type = PyLong_FromLong(mtype), *born = type ? PyLong_FromUnsignedLongLong(start) : NULL;
		if (!born) {
			Py_XDECREF(type);
			goto out;
		}
		item = PyTuple_Pack(7, datagram, type, n_src, n_dst, n_rsrc, carried ? carried : Py_None, born);
		Py_DECREF(type);
		Py_DECREF(born);
	}
	goto out;
raw:
	Py_INCREF(datagram);
	return datagram;
out:
	Py_XDECREF(n_src);
	Py_XDECREF(n_dst);
	Py_XDECREF(n_rsrc);
	Py_XDECREF(carried);
	return item;
}

static int parse_ctx(struct ctx *c, PyObject *names, PyObject *name, PyObject *services, int counting)
{
	Py_ssize_t k;

	if (!configured) {
		PyErr_SetString(PyExc_RuntimeError, "_ctevents.configure() was not called");
		return -1;
	}
	if (!PyDict_Check(names)) {
		PyErr_SetString(PyExc_TypeError, "names must be a dict");
		return -1;
	}
	services = PySequence_Fast(services, "services must be a sequence of (network, mask)");
	if (!services)
		return -1;
	c->names = names, c->name = name, c->counting = counting;
	c->n_services = 0;
	if (PySequence_Fast_GET_SIZE(services) > SERVICES_MAX) { /* not silently fewer: events would be left out */
		Py_DECREF(services);
		PyErr_Format(PyExc_ValueError, "at most %d ranges", SERVICES_MAX);
		return -1;
	}
	for (k = 0; k < PySequence_Fast_GET_SIZE(services); k++) {
		unsigned long net, mask;
		if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(services, k), "kk", &net, &mask)) {
			Py_DECREF(services);
			return -1;
		}
		c->services[k][0] = (uint32_t)net, c->services[k][1] = (uint32_t)mask;
		c->n_services++;
	}
	Py_DECREF(services);
	return 0;
}

/* Append datagram's item to out; 0, or -1 on error. */
static int take(struct ctx *c, PyObject *out, PyObject *datagram)
{
	PyObject *item = event(c, datagram, (const uint8_t *)PyBytes_AS_STRING(datagram), PyBytes_GET_SIZE(datagram));
	int rc;

	if (!item)
		return -1;
	if (item == Py_None)
		return 0;
	rc = PyList_Append(out, item);
	Py_DECREF(item);
	return rc;
}

PyDoc_STRVAR(decode_doc, "decode(datagrams, names, name, services, counting) -> items\n\n"
	     "The items of datagrams already read (a list of bytes), as drain() gives them.");

static PyObject *decode(PyObject *self, PyObject *args)
{
	PyObject *datagrams, *names, *name, *services, *out;
	int counting;
	struct ctx c;

	if (!PyArg_ParseTuple(args, "O!OOOp", &PyList_Type, &datagrams, &names, &name, &services, &counting) ||
	    parse_ctx(&c, names, name, services, counting) < 0)
		return NULL;
	if (!(out = PyList_New(0)))
		return NULL;
	for (Py_ssize_t i = 0; i < PyList_GET_SIZE(datagrams); i++) {
		PyObject *d = PyList_GET_ITEM(datagrams, i);
		if (!PyBytes_Check(d)) {
			PyErr_SetString(PyExc_TypeError, "datagrams must be bytes");
			goto fail;
		}
		if (take(&c, out, d) < 0)
			goto fail;
	}
	return out;
fail:
	Py_DECREF(out);
	return NULL;
}

PyDoc_STRVAR(drain_doc, "drain(fd, budget, names, name, services, counting) -> (items, datagrams, lost)\n\n"
	     "Read the socket (non-blocking) until it is empty or budget datagrams were read, and\n"
	     "their items; datagrams: how many were read; lost: how many times the kernel said it\n"
	     "had dropped events for us (ENOBUFS).  OSError for any other error of the socket.");

static PyObject *drain(PyObject *self, PyObject *args)
{
	PyObject *names, *name, *services, *out;
	int fd, budget, counting, got, total = 0, lost = 0;
	struct ctx c;

	if (!PyArg_ParseTuple(args, "iiOOOp", &fd, &budget, &names, &name, &services, &counting) ||
	    parse_ctx(&c, names, name, services, counting) < 0)
		return NULL;
	if (!bufs) {
		bufs = PyMem_RawMalloc((size_t)BATCH * SLOT);
		if (!bufs)
			return PyErr_NoMemory();
		for (int i = 0; i < BATCH; i++) {
			iovs[i].iov_base = bufs + (size_t)i * SLOT;
			iovs[i].iov_len = SLOT;
		}
	}
	if (!(out = PyList_New(0)))
		return NULL;
	while (total < budget) {
		for (int i = 0; i < BATCH; i++) {
			memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr));
			msgs[i].msg_hdr.msg_iov = &iovs[i];
			msgs[i].msg_hdr.msg_iovlen = 1;
		}
		got = recvmmsg(fd, msgs, BATCH, MSG_DONTWAIT, NULL);
		if (got < 0) {
			if (errno == ENOBUFS) { /* the kernel dropped events for us: what is queued is still there */
				lost++;
				continue;
			}
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
				break;
			PyErr_SetFromErrno(PyExc_OSError);
			goto fail;
		}
		if (got == 0)
			break;
		for (int i = 0; i < got; i++) {
			PyObject *d = PyBytes_FromStringAndSize((const char *)iovs[i].iov_base, msgs[i].msg_len);
			int rc;
			if (!d)
				goto fail;
			rc = take(&c, out, d);
			Py_DECREF(d);
			if (rc < 0)
				goto fail;
		}
		total += got;
	}
	return Py_BuildValue("(Nii)", out, total, lost);
fail:
	Py_DECREF(out);
	return NULL;
}

static int set_layout(struct layout *l, PyObject *mask, PyObject *want)
{
	Py_ssize_t n = PyBytes_GET_SIZE(mask);

	if (n != PyBytes_GET_SIZE(want) || n > LAYOUT_MAX) {
		PyErr_SetString(PyExc_ValueError, "a layout's mask and want are bytes of one length, at most 256");
		return -1;
	}
	l->len = n;
	memcpy(l->mask, PyBytes_AS_STRING(mask), n);
	memcpy(l->want, PyBytes_AS_STRING(want), n);
	return 0;
}

PyDoc_STRVAR(configure_doc, "configure(ports_mask, ports_want, icmp_mask, icmp_want, lifetime_mask, lifetime_want)\n\n"
	     "The layouts of agentd.kernel.netlink_ct (bytes from the first attribute on).  Refused\n"
	     "(ValueError), it changes nothing: the layouts before it stay, or none if there were none.");

static PyObject *configure(PyObject *self, PyObject *args)
{
	PyObject *pm, *pw, *im, *iw, *lm, *lw;
	struct layout p, i, l;

	if (!PyArg_ParseTuple(args, "SSSSSS", &pm, &pw, &im, &iw, &lm, &lw))
		return NULL;
	/* Into locals first: event() reads at fixed offsets as far as the installed layouts
	 * reach, so one installed only in part (a later one refused) would be read past. */
	if (set_layout(&p, pm, pw) < 0 || set_layout(&i, im, iw) < 0 || set_layout(&l, lm, lw) < 0)
		return NULL;
	/* The offsets above are these layouts' (netlink_ct's _PORTS_FIELDS, _ICMP_FIELDS, _LIFETIME_FIELDS). */
	if (p.len != 104 || i.len != 120 || l.len != 212) {
		PyErr_SetString(PyExc_ValueError, "the layouts are not the ones this file reads at fixed offsets");
		return NULL;
	}
	ports = p, icmp = i, lifetime = l;
	configured = 1;
	Py_RETURN_NONE;
}

/* ------------------------------------------------------------ BPF ring buffer records
 *
 * libbpf's ring buffer consumer calls a function per record; called through ctypes that is a
 * Python call per record (a pod fast path's count of a connection whose tuple a new SYN took:
 * one per connection of a client that reuses its ports).  ring_sample is that function in C:
 * it copies each record into a sink (one per ring), and ring_take gives Python the lot. */

struct sink {
	uint8_t *buf;
	size_t len, cap;
};

/* libbpf's ring_buffer_sample_fn: ctx is a struct sink.  Exported, for ctypes to hand libbpf. */
int agentd_ring_sample(void *ctx, void *data, size_t size)
{
	struct sink *s = ctx;
	uint32_t n = (uint32_t)size;

	if (s->len + 4 + size > s->cap) {
		size_t cap = s->cap ? s->cap : 4096;
		uint8_t *grown;
		while (cap < s->len + 4 + size)
			cap *= 2;
		grown = realloc(s->buf, cap);
		if (!grown)
			return -ENOMEM; /* libbpf stops; what was taken stays */
		s->buf = grown, s->cap = cap;
	}
	memcpy(s->buf + s->len, &n, 4);
	memcpy(s->buf + s->len + 4, data, size);
	s->len += 4 + size;
	return 0;
}

PyDoc_STRVAR(ring_sink_doc, "ring_sink() -> address\n\nA new sink for agentd_ring_sample (its ctx).");

static PyObject *ring_sink(PyObject *self, PyObject *args)
{
	struct sink *s = calloc(1, sizeof(*s));

	if (!s)
		return PyErr_NoMemory();
	return PyLong_FromVoidPtr(s);
}

PyDoc_STRVAR(ring_take_doc, "ring_take(sink) -> list of bytes\n\nThe records the sink holds, oldest first; it is emptied.");

static PyObject *ring_take(PyObject *self, PyObject *arg)
{
	struct sink *s = PyLong_AsVoidPtr(arg);
	PyObject *out;
	size_t pos = 0;

	if (!s)
		return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "no sink");
	if (!(out = PyList_New(0)))
		return NULL;
	while (pos + 4 <= s->len) {
		uint32_t n;
		PyObject *rec;
		memcpy(&n, s->buf + pos, 4);
		rec = PyBytes_FromStringAndSize((const char *)s->buf + pos + 4, n);
		if (!rec || PyList_Append(out, rec) < 0) {
			Py_XDECREF(rec);
			Py_DECREF(out);
			return NULL;
		}
		Py_DECREF(rec);
		pos += 4 + n;
	}
	s->len = 0;
	return out;
}

PyDoc_STRVAR(ring_take_fixed_doc,
	     "ring_take_fixed(sink, size) -> (records, count, others, addresses)\n\n"
	     "The records the sink holds that are ``size`` bytes long, side by side in one bytes object, oldest\n"
	     "first; how many; how many of another length (left out); the distinct 4-byte values at offsets 0\n"
	     "and 4 of those records (a set of bytes).  The sink is emptied.");

/* Fixed-size records (a pod program's struct podconn_record: its key's two IPv4 addresses
 * first) handed to Python as one object, with the addresses they name, each once: the agent
 * makes no object per record (agentd/flows/recorder.py, RecordedBatch). */
static PyObject *ring_take_fixed(PyObject *self, PyObject *args)
{
	PyObject *sink_addr, *blob = NULL, *addrs = NULL, *out = NULL;
	Py_ssize_t size, count = 0, others = 0, k = 0;
	uint32_t *seen = NULL;
	uint8_t *used = NULL;
	size_t pos = 0, cap = 16;
	unsigned bits = 4;
	struct sink *s;
	char *dst;

	if (!PyArg_ParseTuple(args, "On", &sink_addr, &size))
		return NULL;
	s = PyLong_AsVoidPtr(sink_addr);
	if (!s)
		return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "no sink");
	if (size < 8)
		return PyErr_Format(PyExc_ValueError, "records of %zd bytes hold no two addresses", size);
	while (pos + 4 <= s->len) {
		uint32_t n;
		memcpy(&n, s->buf + pos, 4);
		if ((Py_ssize_t)n == size)
			count++;
		else
			others++;
		pos += 4 + n;
	}
	if (count > (1 << 26))
		return PyErr_Format(PyExc_OverflowError, "%zd records in one read", count);
	while (cap < (size_t)count * 4)
		cap *= 2, bits++;
	if (!(blob = PyBytes_FromStringAndSize(NULL, count * size)) || !(addrs = PySet_New(NULL)))
		goto done;
	seen = malloc(cap * sizeof(*seen));
	used = calloc(cap, 1);
	if (!seen || !used) {
		PyErr_NoMemory();
		goto done;
	}
	dst = PyBytes_AS_STRING(blob);
	for (pos = 0; pos + 4 <= s->len;) {
		uint32_t n;
		memcpy(&n, s->buf + pos, 4);
		if ((Py_ssize_t)n == size) {
			const uint8_t *rec = s->buf + pos + 4;
			memcpy(dst + k * size, rec, size);
			k++;
			for (int side = 0; side < 2; side++) {
				uint32_t a;
				size_t h;
				memcpy(&a, rec + 4 * side, 4);
				/* The product's high bits (Fibonacci hashing): its low ones depend only on
				 * the address's low bits, the first two octets in network order, which one
				 * pod network shares. */
				h = (uint32_t)(a * 2654435761u) >> (32 - bits);
				while (used[h] && seen[h] != a)
					h = (h + 1) & (cap - 1);
				if (!used[h]) {
					PyObject *b = PyBytes_FromStringAndSize((const char *)rec + 4 * side, 4);
					used[h] = 1, seen[h] = a;
					if (!b || PySet_Add(addrs, b) < 0) {
						Py_XDECREF(b);
						goto done;
					}
					Py_DECREF(b);
				}
			}
		}
		pos += 4 + n;
	}
	s->len = 0;
	out = Py_BuildValue("(OnnO)", blob, count, others, addrs);
done:
	free(seen);
	free(used);
	Py_XDECREF(blob);
	Py_XDECREF(addrs);
	return out;
}

PyDoc_STRVAR(ring_sink_free_doc, "ring_sink_free(sink)\n\nLet go of a sink (after its ring).");

static PyObject *ring_sink_free(PyObject *self, PyObject *arg)
{
	struct sink *s = PyLong_AsVoidPtr(arg);

	if (!s && PyErr_Occurred())
		return NULL;
	if (s) {
		free(s->buf);
		free(s);
	}
	Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
	{"ring_sink", ring_sink, METH_NOARGS, ring_sink_doc},
	{"ring_take", ring_take, METH_O, ring_take_doc},
	{"ring_take_fixed", ring_take_fixed, METH_VARARGS, ring_take_fixed_doc},
	{"ring_sink_free", ring_sink_free, METH_O, ring_sink_free_doc},
	{"configure", configure, METH_VARARGS, configure_doc},
	{"decode", decode, METH_VARARGS, decode_doc},
	{"drain", drain, METH_VARARGS, drain_doc},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "_ctevents", "The flow recorder's per-event loop (conntrack events) in C.", -1, methods,
	NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ctevents(void)
{
	return PyModule_Create(&module);
}
