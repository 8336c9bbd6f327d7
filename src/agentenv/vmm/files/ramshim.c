/*
 * Preloaded into a QEMU whose guest RAM is a private (copy-on-write) mapping of a snapshot's
 * memory file that other guests map as well.
 *
 * When the guest frees pages (balloon inflation, free page reporting) QEMU discards them with
 * fallocate(PUNCH_HOLE) on the RAM file and then madvise(MADV_DONTNEED) on the mapping. The
 * hole would zero those pages of the snapshot under every other guest. For the snapshot file
 * named by AGENTENV_PRIVATE_RAM the punch is skipped and reported as done, so the discard is
 * the madvise alone: the guest's private copies are dropped, and the pages read the snapshot
 * again if the guest ever touches them. Every other file is passed through untouched, and any
 * other fallocate mode on the snapshot file is refused.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>

typedef int (*fallocate_fn)(int, int, off_t, off_t);

static dev_t snap_dev;
static ino_t snap_ino;
static int have_snapshot;

__attribute__((constructor)) static void ramshim_init(void)
{
    const char *path = getenv("AGENTENV_PRIVATE_RAM");
    struct stat st;

    if (path != NULL && stat(path, &st) == 0) {
        snap_dev = st.st_dev;
        snap_ino = st.st_ino;
        have_snapshot = 1;
    }
    /* QEMU's helpers (migration to exec:) have no use for it. */
    unsetenv("LD_PRELOAD");
}

static int is_snapshot(int fd)
{
    struct stat st;

    return have_snapshot && fstat(fd, &st) == 0 && st.st_dev == snap_dev &&
           st.st_ino == snap_ino;
}

static int forward(const char *name, int fd, int mode, off_t offset, off_t len)
{
    fallocate_fn real = (fallocate_fn)dlsym(RTLD_NEXT, name);

    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real(fd, mode, offset, len);
}

static int guarded(const char *name, int fd, int mode, off_t offset, off_t len)
{
    if (is_snapshot(fd)) {
        if (mode == (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE))
            return 0;
        errno = EPERM;
        return -1;
    }
    return forward(name, fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off_t offset, off_t len)
{
    return guarded("fallocate64", fd, mode, offset, len);
}

int fallocate(int fd, int mode, off_t offset, off_t len)
{
    return guarded("fallocate", fd, mode, offset, len);
}
