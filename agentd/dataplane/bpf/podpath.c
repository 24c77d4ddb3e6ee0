// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The pod fast path: a tc ingress program on the host side of each local pod's veth that
 * carries the packets of an already accepted TCP connection between two pods of this node
 * straight into the receiving pod (bpf_redirect_peer), past the bridge, the route-up of
 * isolated pods, conntrack and the policy chains.
 *
 * What decides is the kernel's own connection tracking, looked up with the bpf_skb_ct_lookup
 * kfunc: a packet is carried only when
 *   - it is IPv4 TCP without SYN, FIN or RST (those go the normal way, so conntrack sees every
 *     state change of the connection), not a fragment, without IP options;
 *   - its source address is the pod behind the veth it came in on (the anti-spoofing check
 *     of the normal path) and its destination is another pod of this node;
 *   - conntrack has a confirmed entry for it -- confirmed means the normal path, policy
 *     included, accepted the connection's first packet -- in TCP state ESTABLISHED, with no
 *     NAT on it (a Service's translated flow stays on the normal path, which translates).
 * Anything else is left to the stack (TC_ACT_UNSPEC).  The entry's timeout is renewed as
 * conntrack would renew it, so a busy carried connection does not expire.
 *
 * Conntrack does not see the carried packets, so its TCP window for the connection falls
 * behind; the agent sets nf_conntrack_tcp_be_liberal in the namespace where the fast path is
 * on, so that the connection's FIN and RST (normal path) are not judged out of window.
 *
 * nf_conn's fields are read through CO-RE relocations (the struct below names only what is
 * read; the loader finds the kernel's offsets by name in /sys/kernel/btf/vmlinux).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "podpath.h"

#define PASS TC_ACT_UNSPEC
#define IP_MF_OFFSET 0x3fff
#define CURRENT_NETNS -1
#define TCP_CONNTRACK_ESTABLISHED 3 /* enum tcp_conntrack */
#define IPS_SRC_NAT (1UL << 4)
#define IPS_DST_NAT (1UL << 5)

struct ip_ct_tcp {
	__u8 state;
} __attribute__((preserve_access_index));

union nf_conntrack_proto {
	struct ip_ct_tcp tcp;
} __attribute__((preserve_access_index));

struct nf_conn {
	unsigned long status;
	union nf_conntrack_proto proto;
} __attribute__((preserve_access_index));

/* struct bpf_ct_opts as of Linux 6.0 (NF_BPF_CT_OPTS_SZ, 12 bytes); later kernels take this
 * size too. */
struct ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};

extern struct nf_conn *bpf_skb_ct_lookup(struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 tuple_size,
					 struct ct_opts *opts, __u32 opts_size) __ksym;
extern void bpf_ct_release(struct nf_conn *ct) __ksym;
extern void bpf_ct_change_timeout(struct nf_conn *ct, __u32 timeout_ms) __ksym;

struct agentd_map_def agentd_podips SEC("maps") = {
	.type = BPF_MAP_TYPE_HASH,
	.key_size = sizeof(__be32),
	.value_size = sizeof(struct pod_value),
	.max_entries = 4096,
};

struct agentd_map_def agentd_podstat SEC("maps") = {
	.type = BPF_MAP_TYPE_PERCPU_ARRAY,
	.key_size = sizeof(__u32),
	.value_size = sizeof(struct pod_stats),
	.max_entries = POD_VERDICTS,
};

struct agentd_map_def agentd_podcfg SEC("maps") = {
	.type = BPF_MAP_TYPE_ARRAY,
	.key_size = sizeof(__u32),
	.value_size = sizeof(struct pod_config),
	.max_entries = 1,
};

/* kfuncs are for GPL-compatible programs: dual-licensed as datapath.c is. */
char _license[] SEC("license") = "Dual BSD/GPL";

static __always_inline int count(__u32 verdict, struct __sk_buff *skb, int action)
{
	struct pod_stats *s = bpf_map_lookup_elem(&agentd_podstat, &verdict);

	if (s) {
		s->packets += skb->gso_segs > 1 ? skb->gso_segs : 1;
		s->bytes += skb->len;
	}
	return action;
}

SEC("tc/ingress")
int agentd_pod_fast(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ct_opts opts = {.netns_id = CURRENT_NETNS, .l4proto = IPPROTO_TCP};
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	struct tcphdr *tcp = data + ETH_HLEN + sizeof(*ip);
	struct bpf_sock_tuple tuple = {};
	struct pod_config *cfg;
	struct pod_value *src, *dst;
	struct nf_conn *ct;
	unsigned long status;
	__u32 zero = 0, ifindex;
	__u8 state;

	if ((void *)(tcp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return PASS;
	if (ip->ihl != 5 || ip->protocol != IPPROTO_TCP || (ip->frag_off & bpf_htons(IP_MF_OFFSET)))
		return PASS;
	if (tcp->syn || tcp->fin || tcp->rst)
		return PASS;
	cfg = bpf_map_lookup_elem(&agentd_podcfg, &zero);
	if (!cfg || !(cfg->flags & POD_CFG_ON))
		return PASS;
	src = bpf_map_lookup_elem(&agentd_podips, &ip->saddr);
	if (!src || src->ifindex != skb->ifindex)
		return PASS; /* not this veth's pod: the normal path's spoofing check judges it */
	dst = bpf_map_lookup_elem(&agentd_podips, &ip->daddr);
	if (!dst)
		return PASS; /* leaves the node, or to the node itself */
	ifindex = dst->ifindex;
	tuple.ipv4.saddr = ip->saddr;
	tuple.ipv4.daddr = ip->daddr;
	tuple.ipv4.sport = tcp->source;
	tuple.ipv4.dport = tcp->dest;
	ct = bpf_skb_ct_lookup(skb, &tuple, sizeof(tuple.ipv4), &opts, sizeof(opts));
	if (!ct)
		return count(POD_NO_CONNTRACK, skb, PASS);
	status = ct->status;
	state = ct->proto.tcp.state;
	if (status & (IPS_SRC_NAT | IPS_DST_NAT)) {
		bpf_ct_release(ct);
		return count(POD_NAT, skb, PASS);
	}
	if (state != TCP_CONNTRACK_ESTABLISHED) {
		bpf_ct_release(ct);
		return count(POD_NOT_ESTABLISHED, skb, PASS);
	}
	if (cfg->established_ms)
		bpf_ct_change_timeout(ct, cfg->established_ms);
	bpf_ct_release(ct);
	return count(POD_CARRIED, skb, bpf_redirect_peer(ifindex, 0));
}
