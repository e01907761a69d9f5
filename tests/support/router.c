/* The lab's router in C: the same path model as router.py (its reference), at a fraction of the CPU.

       lab-router COUNTS SEED HOST...
       HOST = namespace,fd,address,delay_ms,jitter_ms,loss,up_mbit,down_mbit,queue_ms

   router.py opens the TUN descriptors (it enters each namespace), writes the ready file and execs
   this program with them; the host fields are router.py's Link fields, `address` a dotted IPv4.
   Per packet, as router.py: through the sender's uplink (rate, finite queue: tail drop), lost with
   the sender's loss probability, delayed by both hosts' delays plus up to both jitters (a flow
   never reordered), through the receiver's downlink (rate, finite queue). Times from
   CLOCK_MONOTONIC; ppoll waits to the nanosecond, so no packet leaves a millisecond late as in
   router.py. SIGTERM ends it; it then writes COUNTS: what each host sent, lost and dropped, and
   its CPU seconds, as router.py does (JSON: {"hosts": {namespace: {sent, lost, dropped}}, "cpu_s"}). */

#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#define MAX_HOSTS 256
#define READS_PER_WAKE 64
#define PACKET_MAX 65536
enum { ARRIVE = 0, DELIVER = 1 };

typedef struct {
    char namespace[64];
    int fd;
    uint32_t address;               /* network order, as in the IPv4 header */
    double delay_s, jitter_s, loss;
    double up_rate, down_rate;      /* bytes per second */
    double up_queue_s, down_queue_s;
    double up_free, down_free;      /* when each link is free again */
    long sent, lost, dropped;
} Host;

typedef struct {
    double when;
    uint64_t sequence;
    int kind, host, length;
    unsigned char *packet;
} Event;

static Host hosts[MAX_HOSTS];
static int host_count;
static double *last_arrival;        /* host_count² : the flow's last arrival, so none is reordered */
static Event *heap;
static size_t heap_size, heap_capacity;
static uint64_t sequence, random_state;
static volatile sig_atomic_t stopped;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double uniform(void) {       /* xorshift64*: [0, 1) */
    random_state ^= random_state >> 12;
    random_state ^= random_state << 25;
    random_state ^= random_state >> 27;
    return (double)((random_state * 0x2545F4914F6CDD1DULL) >> 11) * 0x1.0p-53;
}

static int before(const Event *a, const Event *b) {
    return a->when < b->when || (a->when == b->when && a->sequence < b->sequence);
}

static void push(double when, int kind, int host, unsigned char *packet, int length) {
    if (heap_size == heap_capacity) {
        heap_capacity = heap_capacity ? 2 * heap_capacity : 1024;
        heap = realloc(heap, heap_capacity * sizeof(Event));
        if (heap == NULL) { perror("lab-router: realloc"); exit(1); }
    }
    Event event = {when, ++sequence, kind, host, length, packet};
    size_t i = heap_size++;
    while (i > 0 && before(&event, &heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = event;
}

static Event pop(void) {
    Event top = heap[0], last = heap[--heap_size];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= heap_size) break;
        if (child + 1 < heap_size && before(&heap[child + 1], &heap[child])) child++;
        if (!before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (heap_size) heap[i] = last;
    return top;
}

static double queue_s(double queue_ms, double rate) {
    double floor_s = 64.0 * 1024.0 / rate;
    return queue_ms / 1000.0 > floor_s ? queue_ms / 1000.0 : floor_s;
}

/* A packet `source` wrote: through its uplink, the loss, the path's delay. Takes `packet`. */
static void sent(int source, unsigned char *packet, int length, double now) {
    Host *host = &hosts[source];
    int target = -1;
    if (length >= 20 && packet[0] >> 4 == 4) {
        uint32_t destination;
        memcpy(&destination, packet + 16, 4);
        for (int i = 0; i < host_count; i++) if (hosts[i].address == destination) { target = i; break; }
    }
    if (target < 0 || target == source) { free(packet); return; }  /* IPv4 to another host only */
    double start = now > host->up_free ? now : host->up_free;
    if (start - now > host->up_queue_s) { host->dropped++; free(packet); return; }
    host->up_free = start + length / host->up_rate;
    host->sent++;
    if (uniform() < host->loss) { host->lost++; free(packet); return; }
    Host *other = &hosts[target];
    double jitter = host->jitter_s + other->jitter_s;
    double arrival = host->up_free + host->delay_s + other->delay_s + (jitter > 0 ? uniform() * jitter : 0.0);
    double *last = &last_arrival[source * host_count + target];
    if (arrival < *last) arrival = *last;
    *last = arrival;
    push(arrival, ARRIVE, target, packet, length);
}

static void arrived(Event event, double now) {
    Host *host = &hosts[event.host];
    double start = now > host->down_free ? now : host->down_free;
    if (start - now > host->down_queue_s) { host->dropped++; free(event.packet); return; }
    host->down_free = start + event.length / host->down_rate;
    push(host->down_free, DELIVER, event.host, event.packet, event.length);
}

static void on_term(int signum) { (void)signum; stopped = 1; }

static int parse_host(const char *text, Host *host) {
    char address[64];
    double up_mbit, down_mbit, queue_ms, delay_ms, jitter_ms;
    if (sscanf(text, "%63[^,],%d,%63[^,],%lf,%lf,%lf,%lf,%lf,%lf", host->namespace, &host->fd, address,
               &delay_ms, &jitter_ms, &host->loss, &up_mbit, &down_mbit, &queue_ms) != 9)
        return -1;
    struct in_addr parsed;
    if (inet_pton(AF_INET, address, &parsed) != 1 || up_mbit <= 0 || down_mbit <= 0) return -1;
    host->address = parsed.s_addr;
    host->delay_s = delay_ms / 1000.0;
    host->jitter_s = jitter_ms / 1000.0;
    host->up_rate = up_mbit * 1e6 / 8;
    host->down_rate = down_mbit * 1e6 / 8;
    host->up_queue_s = queue_s(queue_ms, host->up_rate);
    host->down_queue_s = queue_s(queue_ms, host->down_rate);
    return 0;
}

static void write_counts(const char *path) {
    FILE *out = fopen(path, "w");
    if (out == NULL) { perror("lab-router: counts"); return; }
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    double cpu = usage.ru_utime.tv_sec + usage.ru_utime.tv_usec * 1e-6 + usage.ru_stime.tv_sec +
                 usage.ru_stime.tv_usec * 1e-6;
    fprintf(out, "{\"hosts\": {");
    for (int i = 0; i < host_count; i++)
        fprintf(out, "%s\"%s\": {\"sent\": %ld, \"lost\": %ld, \"dropped\": %ld}", i ? ", " : "",
                hosts[i].namespace, hosts[i].sent, hosts[i].lost, hosts[i].dropped);
    fprintf(out, "}, \"cpu_s\": %.2f}\n", cpu);
    fclose(out);
}

int main(int argc, char **argv) {
    if (argc < 4 || argc - 3 > MAX_HOSTS) {
        fprintf(stderr, "usage: %s COUNTS SEED HOST... (at most %d hosts)\n", argv[0], MAX_HOSTS);
        return 2;
    }
    random_state = strtoull(argv[2], NULL, 10) * 0x9E3779B97F4A7C15ULL + 1;
    host_count = argc - 3;
    for (int i = 0; i < host_count; i++) {
        if (parse_host(argv[3 + i], &hosts[i]) != 0) {
            fprintf(stderr, "lab-router: bad host %s\n", argv[3 + i]);
            return 2;
        }
    }
    last_arrival = calloc((size_t)host_count * host_count, sizeof(double));
    struct pollfd *polls = calloc(host_count, sizeof(struct pollfd));
    if (last_arrival == NULL || polls == NULL) { perror("lab-router: calloc"); return 1; }
    for (int i = 0; i < host_count; i++) polls[i] = (struct pollfd){.fd = hosts[i].fd, .events = POLLIN};
    struct sigaction action = {0};
    action.sa_handler = on_term;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    while (!stopped) {
        double now = now_s();
        while (heap_size && heap[0].when <= now) {
            Event event = pop();
            if (event.kind == ARRIVE) {
                arrived(event, now);
            } else {
                if (write(hosts[event.host].fd, event.packet, event.length) < 0) hosts[event.host].dropped++;
                free(event.packet);
            }
        }
        struct timespec wait = {1, 0};
        if (heap_size) {
            double seconds = heap[0].when - now_s();
            if (seconds < 0) seconds = 0;
            wait.tv_sec = (time_t)seconds;
            wait.tv_nsec = (long)((seconds - (double)wait.tv_sec) * 1e9);
        }
        int ready = ppoll(polls, host_count, &wait, NULL);
        if (ready < 0) {
            if (errno == EINTR) continue;
            perror("lab-router: ppoll");
            return 1;
        }
        for (int i = 0; i < host_count && ready > 0; i++) {
            if (!(polls[i].revents & POLLIN)) continue;
            for (int r = 0; r < READS_PER_WAKE; r++) {
                unsigned char *packet = malloc(PACKET_MAX);
                if (packet == NULL) { perror("lab-router: malloc"); return 1; }
                ssize_t length = read(hosts[i].fd, packet, PACKET_MAX);
                if (length <= 0) { free(packet); break; }
                unsigned char *fitted = realloc(packet, (size_t)length);
                sent(i, fitted ? fitted : packet, (int)length, now_s());
            }
        }
    }
    if (strcmp(argv[1], "-") != 0) write_counts(argv[1]);
    return 0;
}
