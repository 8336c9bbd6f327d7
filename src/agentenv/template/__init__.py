"""Guest artifacts and templates.

Entry points: ``artifacts.ensure_all`` (kernel, initramfs, tools layer), ``artifacts.
kernel_cmdline`` / ``artifacts.guest_args`` (the guest command line), ``rootfs.ensure_base``
(the ``base`` template), ``kernel_build.build_custom`` (`aenv kernel build`), ``catalog.
TemplateCatalog``. Everything is cached under ``settings.cache`` by a hash of its inputs.
"""
