/* The stack-chain program's entry: main -> chain_main (libstackchain.so). Built with frame pointers. */
int chain_main(int argc, char **argv);

__attribute__((noinline)) int main(int argc, char **argv) {
    int rc = chain_main(argc, argv);
    __asm__ volatile("" ::: "memory");
    return rc;
}
