/* _dl_find_object for a static musl program: Debian's aarch64 libgcc_eh.a
 * (built against glibc >= 2.35) looks up a PC's unwind tables with it, and
 * musl does not have it. Same contract as glibc's: 0 and the object's
 * PT_GNU_EH_FRAME when PC is inside a loaded object, -1 otherwise. */
#define _GNU_SOURCE
#include <link.h>
#include <stddef.h>
#include <stdint.h>

struct dl_find_object {
    unsigned long long dlfo_flags;
    void *dlfo_map_start;
    void *dlfo_map_end;
    struct link_map *dlfo_link_map;
    void *dlfo_eh_frame;
    unsigned long long dlfo_reserved[7];
};

struct lookup {
    uintptr_t pc;
    struct dl_find_object *out;
};

static int visit(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct lookup *l = data;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    void *eh = NULL;
    int hit = 0;
    for (size_t i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *p = &info->dlpi_phdr[i];
        uintptr_t start = info->dlpi_addr + p->p_vaddr;
        if (p->p_type == PT_LOAD) {
            if (start < lo) lo = start;
            if (start + p->p_memsz > hi) hi = start + p->p_memsz;
            if (l->pc >= start && l->pc < start + p->p_memsz) hit = 1;
        } else if (p->p_type == PT_GNU_EH_FRAME) {
            eh = (void *)start;
        }
    }
    if (!hit) return 0;
    l->out->dlfo_flags = 0;
    l->out->dlfo_map_start = (void *)lo;
    l->out->dlfo_map_end = (void *)hi;
    l->out->dlfo_link_map = NULL;
    l->out->dlfo_eh_frame = eh;
    return 1;
}

int _dl_find_object(void *pc, struct dl_find_object *result) {
    struct lookup l = { (uintptr_t)pc, result };
    return dl_iterate_phdr(visit, &l) == 1 ? 0 : -1;
}
