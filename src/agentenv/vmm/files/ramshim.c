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
 *
 * QEMU opens its RAM file read-write even for a private mapping. The snapshot file is opened
 * read-only instead (a private mapping writes to memory, never to the file), so it can be a
 * read-only file on a read-only mount: a confined QEMU gets no descriptor by which it could
 * change a file every other guest maps.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

typedef int (*fallocate_fn)(int, int, off_t, off_t);
typedef int (*open_fn)(const char *, int, ...);

static char *snap_path;
static dev_t snap_dev;
static ino_t snap_ino;
static int have_snapshot;

__attribute__((constructor)) static void ramshim_init(void)
{
    const char *path = getenv("AGENTENV_PRIVATE_RAM");
    struct stat st;

    if (path != NULL)
        snap_path = strdup(path);
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

static int open_flags(const char *path, int flags)
{
    if (snap_path != NULL && path != NULL && (flags & O_ACCMODE) == O_RDWR &&
        !(flags & O_CREAT) && strcmp(path, snap_path) == 0)
        return (flags & ~O_ACCMODE) | O_RDONLY;
    return flags;
}

static int open_via(const char *name, const char *path, int flags, mode_t mode)
{
    open_fn real = (open_fn)dlsym(RTLD_NEXT, name);

    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real(path, open_flags(path, flags), mode);
}

static int needs_mode(int flags)
{
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE;
}

int open(const char *path, int flags, ...)
{
    mode_t mode = 0;

    if (needs_mode(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, int);
        va_end(ap);
    }
    return open_via("open", path, flags, mode);
}

int open64(const char *path, int flags, ...)
{
    mode_t mode = 0;

    if (needs_mode(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, int);
        va_end(ap);
    }
    return open_via("open64", path, flags, mode);
}

/* What `open` compiles to under _FORTIFY_SOURCE when the flags are not a constant (QEMU's
 * RAM file open is one of those). */
typedef int (*open2_fn)(const char *, int);

static int open2_via(const char *name, const char *path, int flags)
{
    open2_fn real = (open2_fn)dlsym(RTLD_NEXT, name);

    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real(path, open_flags(path, flags));
}

int __open_2(const char *path, int flags)
{
    return open2_via("__open_2", path, flags);
}

int __open64_2(const char *path, int flags)
{
    return open2_via("__open64_2", path, flags);
}
