/* Fault injection below Python for tests/test_durability.py (LD_PRELOAD).
 *
 * Wraps fsync, fdatasync, write, writev and close.  Each fails when the path of its file descriptor
 * (readlink /proc/self/fd/N) contains the substring in an environment variable:
 *
 *   CKPT_FAIL_FSYNC=pattern   fsync and fdatasync fail with EIO (nothing is synced)
 *   CKPT_FAIL_WRITE=pattern   write and writev fail with ENOSPC (nothing is written)
 *   CKPT_FAIL_CLOSE=pattern   close closes the descriptor, then reports EIO (as NFS can)
 *   CKPT_FAIL_DIRS_ONLY=1     only descriptors of directories match (fsync of a folder)
 *
 * A pattern ending in '$' matches the end of the path only.  The variables are read at every
 * call, so a process may set them (os.environ) after it starts.
 *
 * Build: cc -shared -fPIC -o fault_shim.so fault_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

static int matches(int fd, const char *var) {
    const char *pattern = getenv(var);
    if (pattern == NULL || pattern[0] == '\0' || fd < 0)
        return 0;
    const char *dirs_only = getenv("CKPT_FAIL_DIRS_ONLY");
    if (dirs_only != NULL && dirs_only[0] == '1') {
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode))
            return 0;
    }
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0)
        return 0;
    path[n] = '\0';
    size_t plen = strlen(pattern);
    if (pattern[plen - 1] == '$') {
        size_t want = plen - 1;
        return (size_t)n >= want && strncmp(path + n - want, pattern, want) == 0;
    }
    return strstr(path, pattern) != NULL;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real)
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (matches(fd, "CKPT_FAIL_FSYNC")) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real)
        real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (matches(fd, "CKPT_FAIL_FSYNC")) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

ssize_t write(int fd, const void *buf, size_t count) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real)
        real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (count > 0 && matches(fd, "CKPT_FAIL_WRITE")) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, buf, count);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    static ssize_t (*real)(int, const struct iovec *, int);
    if (!real)
        real = (ssize_t (*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
    if (iovcnt > 0 && matches(fd, "CKPT_FAIL_WRITE")) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, iov, iovcnt);
}

int close(int fd) {
    static int (*real)(int);
    if (!real)
        real = (int (*)(int))dlsym(RTLD_NEXT, "close");
    int fail = matches(fd, "CKPT_FAIL_CLOSE");
    int rc = real(fd);
    if (fail && rc == 0) {
        errno = EIO;
        return -1;
    }
    return rc;
}
