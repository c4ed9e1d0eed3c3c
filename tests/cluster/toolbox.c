/* A static multi-call binary for the node tier's test pods: the image has nothing else,
 * so everything a test asks from inside a container is one of these verbs.
 *
 *   toolbox sleep [FILE]       write FILE (if given) and wait for SIGTERM, then exit 0
 *   toolbox echo WORD...       print the words
 *   toolbox cat FILE           print a file (/proc/mounts, /proc/self/status, ...)
 *   toolbox connect IP PORT    open a TCP connection (5 s), print "connected IP:PORT"
 *   toolbox chown UID GID PATH give PATH to UID:GID (needs CAP_CHOWN when not the owner)
 *
 * Built with `gcc -static` by tests/cluster/images.py; no libc beyond the static one.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void on_term(int signo) {
  (void)signo;
  fprintf(stderr, "toolbox: terminating\n");
  exit(0);
}

static int do_sleep(int argc, char **argv) {
  signal(SIGTERM, on_term);
  signal(SIGINT, on_term);
  if (argc > 2) {
    FILE *f = fopen(argv[2], "w");
    if (!f) {
      perror(argv[2]);
      return 1;
    }
    fputs("ready\n", f);
    fclose(f);
  }
  printf("toolbox: started\n");
  fflush(stdout);
  for (;;)
    pause();
}

static int do_cat(const char *path) {
  char buf[4096];
  ssize_t n;
  int fd = open(path, O_RDONLY);
  if (fd < 0) {
    perror(path);
    return 1;
  }
  while ((n = read(fd, buf, sizeof buf)) > 0)
    fwrite(buf, 1, (size_t)n, stdout);
  close(fd);
  return n < 0;
}

static int do_connect(const char *ip, const char *port) {
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
  if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) {
    fprintf(stderr, "toolbox: not an IPv4 address: %s\n", ip);
    return 2;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0 || (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS)) {
    perror("connect");
    return 1;
  }
  struct pollfd p = {.fd = fd, .events = POLLOUT};
  int err = 0;
  socklen_t len = sizeof err;
  if (poll(&p, 1, 5000) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err) {
    fprintf(stderr, "toolbox: connect %s:%s failed: %s\n", ip, port, err ? strerror(err) : "timeout");
    return 1;
  }
  printf("connected %s:%s\n", ip, port);
  close(fd);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "sleep"))
    return do_sleep(argc, argv);
  if (argc >= 2 && !strcmp(argv[1], "echo")) {
    for (int i = 2; i < argc; i++)
      printf(i > 2 ? " %s" : "%s", argv[i]);
    printf("\n");
    return 0;
  }
  if (argc == 3 && !strcmp(argv[1], "cat"))
    return do_cat(argv[2]);
  if (argc == 4 && !strcmp(argv[1], "connect"))
    return do_connect(argv[2], argv[3]);
  if (argc == 5 && !strcmp(argv[1], "chown")) {
    if (chown(argv[4], (uid_t)atoi(argv[2]), (gid_t)atoi(argv[3])) < 0) {
      perror(argv[4]);
      return 1;
    }
    printf("chowned %s to %s:%s\n", argv[4], argv[2], argv[3]);
    return 0;
  }
  fprintf(stderr, "usage: toolbox sleep [FILE] | echo WORD... | cat FILE | connect IP PORT"
                  " | chown UID GID PATH\n");
  return 2;
}
