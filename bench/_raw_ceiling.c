/* The ceiling of any IPIP path built on raw sockets, for bench/dataplane.py: one process sends
 * MTU-sized IP-protocol-4 packets through a raw socket with sendmmsg (as the user-space IPIP
 * worker does, batches of 64), another drains a raw socket for protocol 4 with recvmmsg.  No
 * TUN, no TCP, no per-packet user-space work: what is left is the kernel's own per-packet cost.
 *
 *   _raw_ceiling send DST SECONDS LEN     prints "sent N"
 *   _raw_ceiling recv                     prints "ready", then "received N SECONDS" (it stops 1 s after
 *                                         the last packet, or after 60 s without one)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define BATCH 64

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    static char buf[BATCH][2048];
    struct mmsghdr m[BATCH];
    struct iovec v[BATCH];
    struct sockaddr_in to = {.sin_family = AF_INET};
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_IPIP);
    if (s < 0 || argc < 2) {
        perror("_raw_ceiling");
        return 1;
    }
    int sending = strcmp(argv[1], "send") == 0;
    if (sending && (argc < 5 || inet_pton(AF_INET, argv[2], &to.sin_addr) != 1)) {
        fprintf(stderr, "usage: _raw_ceiling send DST SECONDS LEN | recv\n");
        return 1;
    }
    int len = sending ? atoi(argv[4]) : 2048;
    memset(m, 0, sizeof m);
    for (int i = 0; i < BATCH; i++) {
        if (sending) { /* an inner IPv4 header: version/IHL, total length, TTL, protocol TCP */
            buf[i][0] = 0x45;
            buf[i][2] = (char)(len >> 8);
            buf[i][3] = (char)(len & 255);
            buf[i][8] = 64;
            buf[i][9] = 6;
            m[i].msg_hdr.msg_name = &to;
            m[i].msg_hdr.msg_namelen = sizeof to;
        }
        v[i].iov_base = buf[i];
        v[i].iov_len = (size_t)len;
        m[i].msg_hdr.msg_iov = &v[i];
        m[i].msg_hdr.msg_iovlen = 1;
    }
    long n = 0;
    if (sending) {
        int pmtu = IP_PMTUDISC_DO;
        setsockopt(s, IPPROTO_IP, IP_MTU_DISCOVER, &pmtu, sizeof pmtu);
        double t0 = now(), secs = atof(argv[3]);
        while (now() - t0 < secs) {
            int r = sendmmsg(s, m, BATCH, 0);
            if (r > 0)
                n += r;
        }
        printf("sent %ld\n", n);
        return 0;
    }
    struct timeval tv = {1, 0};
    int rcvbuf = 8 << 20;
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    double t0 = 0, t1 = 0, start = now();
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        int r = recvmmsg(s, m, BATCH, 0, NULL);
        if (r <= 0) {
            if (t0 > 0 || now() - start > 60)
                break;
            continue;
        }
        if (t0 == 0)
            t0 = now();
        n += r;
        t1 = now();
    }
    printf("received %ld %.6f\n", n, t1 - t0);
    return 0;
}
